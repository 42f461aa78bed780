"""Peer-memory checkpoints (``--local-checkpoint-interval``): which copies a relaunch takes, the files'
checksums, and a relaunch after a lost host that resumes from its peer's copy without reading the disk.

The reference for the relaunch is the same run uninterrupted: its per-microbatch losses after the
restored iteration must be equal (dropout on, so the random states must come back too)."""

import os
import shutil

import pytest
import torch
import torch.distributed as dist

from checkpoint_helpers import session_cache, train
from megapipe.checkpointing import paths
from megapipe.checkpointing.common import Common, SavedLayout
from megapipe.checkpointing.peer_memory import Held, choose, decode, encode, read_copies, write_copy
from megapipe.checkpointing.shards import Shard
from megapipe.testing.worlds import run_distributed

LAYOUT = str(SavedLayout(1, 1, 2))


def _held(owner, iteration, holder, problem=None, layout=LAYOUT):
    return Held(owner, iteration, holder, f"host-{holder}", 10, "d", layout, problem)


@pytest.mark.unit
def test_the_newest_complete_iteration_is_chosen_and_each_rank_takes_its_own_copy_first():
    held = [_held(0, 6, 0), _held(1, 6, 0), _held(1, 6, 1), _held(0, 3, 0), _held(1, 3, 0)]
    iteration, sources, notes = choose(held, 2, LAYOUT, disk_iteration=4)
    assert iteration == 6 and notes == []
    assert {owner: copy.holder for owner, copy in sources.items()} == {0: 0, 1: 1}
    # host 1 lost: rank 1's state comes from the copy rank 0 holds
    iteration, sources, _ = choose(held[:2], 2, LAYOUT, disk_iteration=4)
    assert iteration == 6 and sources[1].holder == 0


@pytest.mark.unit
def test_damaged_stale_and_foreign_copies_are_passed_over_and_named():
    damaged = [_held(0, 6, 0), _held(1, 6, 0, "fails its checksum"), _held(0, 3, 0), _held(1, 3, 0)]
    iteration, _, notes = choose(damaged, 2, LAYOUT, disk_iteration=None)
    assert iteration == 3
    assert notes == ["the copy of rank 1's state at iteration 6 held by rank 0 (host-0) fails its checksum: not used",
                     "iteration 6 is incomplete: no good copy of the state of rank(s) 1"]
    assert choose(damaged, 2, LAYOUT, disk_iteration=4)[0] is None  # 3 is older than the disk's 4
    iteration, sources, notes = choose(damaged, 2, LAYOUT, disk_iteration=6)  # the disk holds 6 too
    assert iteration == 6 and list(sources) == [0] and notes[-1] == (
        "no good copy of the state of rank(s) 1 at iteration 6: read from the disk checkpoint of that iteration")
    foreign = [_held(0, 6, 0, layout="(t, p, d) = (2, 1, 1)"), _held(1, 6, 0)]
    iteration, _, notes = choose(foreign, 2, LAYOUT, disk_iteration=None)
    assert iteration is None and "was written with (t, p, d) = (2, 1, 1), not this run's (t, p, d) = (1, 1, 2)" in notes[0]


def _common(iteration):
    return Common("gpt", iteration, 8 * iteration, 0, SavedLayout(1, 1, 2), {"model": {}}, None, None, True, True)


@pytest.mark.unit
def test_a_copy_round_trips_and_a_flipped_or_missing_byte_is_refused(tmp_path):
    shards = {"model/w": Shard(torch.arange(6.0).view(2, 3), (4, 3), (2, 0)), "rng/rank_0/cpu": Shard.whole(
        torch.arange(5, dtype=torch.uint8))}
    payload = encode(shards, _common(6))
    back, common = decode(payload, "test")
    assert common == _common(6)
    assert all(torch.equal(back[k].local, s.local) and back[k].global_shape == s.global_shape
               and back[k].offsets == s.offsets for k, s in shards.items())
    directory = str(tmp_path)
    write_copy(directory, 1, 6, LAYOUT, payload)
    write_copy(directory, 0, 6, LAYOUT, payload)
    held, payloads = read_copies(directory, 0)
    assert [c.problem for c in held] == [None, None] and payloads[(1, 6)] == payload
    names = sorted(os.listdir(directory))
    with open(os.path.join(directory, names[0]), "r+b") as f:  # rank 0's copy: one byte flipped near the end
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with open(os.path.join(directory, names[1]), "r+b") as f:  # rank 1's copy: cut short
        f.truncate(os.path.getsize(os.path.join(directory, names[1])) - 5)
    held, payloads = read_copies(directory, 0)
    assert [c.problem for c in held] == ["fails its checksum", f"is cut short ({len(payload) - 5} of {len(payload)} bytes)"]
    assert payloads == {}


FLAGS = ["--use-distributed-optimizer", "--train-iters", "10", "--lr", "0.01"]


def _lose_host_and_relaunch(rank, world_size, root, cache):
    """Run A stops after iteration 7 with copies at 3 and 6 and disk checkpoints at 4 (its exit checkpoint at 7 is
    removed: the disk holds 4, as after a crash). Relaunch B1 finds rank 1's copy at rank 0 damaged and loads the
    disk; relaunch B2, with rank 1's host memory gone and the disk's shard files emptied, restores iteration 6
    from rank 0's copy. Then, with disk checkpoints at 3 and 6 as well and both copies of rank 1's state lost,
    rank 0 restores its copy of 6 and rank 1 reads its state from the disk's 6. Each must train on exactly as the
    uninterrupted run."""
    disk, local = os.path.join(root, "ckpt"), os.path.join(root, "local")
    keep = ["--save", disk, "--load", disk, "--save-interval", "4", "--local-checkpoint-interval", "3",
            "--local-checkpoint-dir", local]
    _, reference = train(FLAGS, cache)
    _, first = train(FLAGS + keep + ["--exit-interval", "7"], cache)
    assert first == reference[:7]
    dist.barrier()
    if rank == 0:  # the crash came before the exit checkpoint
        shutil.rmtree(paths.iteration_dir(disk, 7))
        with open(os.path.join(disk, paths.LATEST), "w") as f:
            f.write("4")
        shutil.copytree(root, root + ".pristine")
    dist.barrier()
    held_for_rank_1 = os.path.join(local, "local_rank_0", "iter_0000006_rank_00001.bin")
    if rank == 0:
        with open(held_for_rank_1, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    else:
        shutil.rmtree(os.path.join(local, "local_rank_1"))
    dist.barrier()
    _, from_disk = train(FLAGS + keep, cache)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
        shutil.copytree(root + ".pristine", root)
        shutil.rmtree(os.path.join(local, "local_rank_1"))  # host 1's memory is gone
        for name in os.listdir(paths.iteration_dir(disk, 4)):
            if name.endswith(".distcp"):
                open(os.path.join(paths.iteration_dir(disk, 4), name), "w").close()  # a read would fail
    dist.barrier()
    _, from_peer = train(FLAGS + keep, cache)
    dist.barrier()
    if rank == 0:  # disk checkpoints at 3 and 6 as well: rank 1's state, of which no copy is left, comes from there
        shutil.rmtree(root)
        shutil.copytree(root + ".pristine", root)
        shutil.rmtree(local)  # a fresh run
        shutil.rmtree(disk)
    dist.barrier()
    _, second = train(FLAGS + keep + ["--save-interval", "3", "--exit-interval", "7"], cache)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(paths.iteration_dir(disk, 7))
        with open(os.path.join(disk, paths.LATEST), "w") as f:
            f.write("6")
        shutil.rmtree(os.path.join(local, "local_rank_1"))  # host 1's memory is gone,
        os.remove(held_for_rank_1)  # and so is the copy host 0 held of it
    dist.barrier()
    _, mixed = train(FLAGS + keep + ["--save-interval", "3"], cache)
    return from_disk == reference[4:], from_peer == reference[6:], second == reference[:7] and mixed == reference[6:]


@pytest.mark.distributed
def test_a_relaunch_after_a_host_loss_resumes_from_the_peers_copy_without_the_disk(tmp_path, tmp_path_factory):
    results = run_distributed(2, _lose_host_and_relaunch, str(tmp_path / "run"), session_cache(tmp_path_factory),
                              timeout=300)
    assert results == [(True, True, True), (True, True, True)]
