"""Bad checkpoints and interrupted saves: one clear sentence, the model untouched, nothing half done.

One Trainer (a world of one) trains and saves, then tries to load each damaged copy of its
checkpoint; every attempt must raise CheckpointError with the sentence below and leave every
weight and optimizer moment exactly as it was. A second world kills a rank with SIGKILL in
the middle of writing a checkpoint: the previous checkpoint and ``latest`` must survive.
"""

import os
import shutil
import signal

import pytest
import torch

from checkpoint_helpers import build, session_cache, train
from megapipe.checkpointing import paths
from megapipe.checkpointing.offline import read_checkpoint
from megapipe.errors import CheckpointError
from megapipe.testing.worlds import DistributedFailure, run_distributed

SHORT = ["--train-iters", "2", "--save-interval", "1"]


def _snapshot(trainer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for chunk in trainer.chunks for p in chunk.parameters()]
    state = trainer.engine.optimizer.inner.state
    return tensors + [v.clone() for s in state.values() for v in s.values()]


def _damaged_copies(root: str, good: str) -> dict[str, str]:
    """Damaged variants of the checkpoint ``good``, by the sentence fragment each must raise."""
    def copy(name):
        target = os.path.join(root, name)
        shutil.copytree(good, target)
        return target

    missing = copy("missing-shard")
    os.remove(os.path.join(missing, "__0_0.distcp"))
    truncated = copy("truncated-shard")
    with open(os.path.join(truncated, "__0_0.distcp"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    scrambled = copy("scrambled-shard")  # right length, unreadable bytes: fails while reading
    with open(os.path.join(scrambled, "__0_0.distcp"), "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        f.write(b"\0" * 4096)
    empty = os.path.join(root, "empty")
    os.makedirs(empty)
    return {os.path.join(root, "nowhere"): "does not exist",
            empty: "holds no checkpoint: it has no latest_checkpointed_iteration.txt",
            missing: "shard file __0_0.distcp is missing",
            truncated: "shard file __0_0.distcp is truncated",
            scrambled: "reading checkpoint"}


def _faults_world(rank, world_size, root, cache):
    good_root = os.path.join(root, "good")
    trainer, _ = train(SHORT + ["--save", good_root], cache)
    messages = {}
    trainer.config.training.no_save_optim = True
    trainer.checkpointer.save(os.path.join(root, "weights-only"))
    trainer.config.training.no_save_optim = False
    before = _snapshot(trainer)
    cases = _damaged_copies(root, os.path.join(good_root, "iter_0000002"))
    cases[os.path.join(root, "weights-only")] = "has no optimizer state (saved with --no-save-optim"
    for directory, expected in cases.items():
        with pytest.raises(CheckpointError) as error:
            trainer.checkpointer.load(directory)
        messages[expected] = str(error.value)
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(trainer))), directory
    trainer.config.training.no_load_optim = True  # the weights-only checkpoint loads without its optimizer
    trainer.checkpointer.load(os.path.join(root, "weights-only"))
    trainer.config.training.no_load_optim, trainer.config.training.finetune = False, True
    trainer.state.iteration = 0
    trainer.checkpointer.load(os.path.join(good_root, "iter_0000001"))  # weights of iteration 1, from iteration 0
    _, _, saved = read_checkpoint(os.path.join(good_root, "iter_0000001"))
    weights = dict(trainer.chunks[0].named_parameters())
    assert trainer.state.iteration == 0
    assert torch.equal(weights["layers.0.mlp.fc1.weight"], saved["model/layers.0.mlp.fc1.weight"])
    wide = build(["--hidden-size", "64"], cache)
    with pytest.raises(CheckpointError) as error:
        wide.checkpointer.load(good_root)
    messages["shape"] = str(error.value)
    return messages


@pytest.fixture(scope="module")
def fault_messages(tmp_path_factory):
    return run_distributed(1, _faults_world, str(tmp_path_factory.mktemp("faults")), session_cache(tmp_path_factory),
                           timeout=300)[0]


@pytest.mark.distributed
def test_each_damaged_checkpoint_is_one_sentence_and_the_model_is_untouched(fault_messages):
    for expected, message in fault_messages.items():
        if expected != "shape":
            assert expected in message
            assert "\n" not in message and message.endswith("."), message


@pytest.mark.distributed
def test_a_different_model_names_the_first_mismatching_tensor_and_both_shapes(fault_messages):
    message = fault_messages["shape"]
    assert "'model/embedding.word_embeddings.weight' has shape [261, 32] in the checkpoint but [261, 64]" in message
    assert "--hidden-size 32 vs 64" in message


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_while_saving(rank, world_size, root, cache):
    trainer, _ = train(["--pipeline-model-parallel-size", "2", "--train-iters", "2"], cache)
    trainer.checkpointer.save(os.path.join(root, "ckpt"))  # iteration 2
    trainer.state.iteration = 3
    if rank == 1:  # dies once its shard file is written, when DCP syncs it
        os.fsync = _die
    trainer.checkpointer.save(os.path.join(root, "ckpt"))


@pytest.mark.distributed
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path, tmp_path_factory):
    with pytest.raises(DistributedFailure) as failure:
        run_distributed(2, _killed_while_saving, str(tmp_path), session_cache(tmp_path_factory), timeout=300,
                        collective_timeout=30)
    # whichever the harness notices first: rank 1's death, or rank 0 losing its peer in the save's collective
    assert "rank 1 died" in str(failure.value) or "by peer" in str(failure.value)
    root = os.path.join(tmp_path, "ckpt")
    assert paths.read_latest(root) == 2
    assert not os.path.exists(paths.iteration_dir(root, 3))
    directory, common, tensors = read_checkpoint(root)
    assert directory == paths.iteration_dir(root, 2) and common.iteration == 2 and tensors


@pytest.mark.unit
@pytest.mark.parametrize("dies_in", ["rename", "write_atomically"])
def test_a_crash_while_publishing_keeps_latest_on_a_complete_checkpoint(tmp_path, monkeypatch, dies_in):
    root = str(tmp_path)
    for iteration in (1, 2):
        _stage_empty_checkpoint(root, iteration)
        if iteration == 2:
            monkeypatch.setattr(paths.os if dies_in == "rename" else paths, dies_in, _raise)
        try:
            paths.publish(root, iteration)
        except KeyboardInterrupt:
            pass
    assert paths.read_latest(root) == 1
    assert paths.find_checkpoint(root) == paths.iteration_dir(root, 1)


def _stage_empty_checkpoint(root: str, iteration: int) -> None:
    """A staged checkpoint of ``iteration`` with the files publication looks for, empty."""
    staging = paths.prepare_staging(root, iteration)
    for name in (paths.COMMON, paths.METADATA):
        open(os.path.join(staging, name), "w").close()


def _raise(*args, **kwargs):
    raise KeyboardInterrupt  # stands for the process dying at this point


@pytest.mark.unit
def test_the_next_publication_removes_what_killed_saves_left(tmp_path):
    root = str(tmp_path)
    for iteration in (1, 2):
        _stage_empty_checkpoint(root, iteration)
        if iteration == 1:
            paths.publish(root, 1)
    os.rename(paths.iteration_dir(root, 1), paths.iteration_dir(root, 1) + paths.REPLACED_SUFFIX)  # killed re-saving 1
    open(os.path.join(root, f"{paths.LATEST}.123{paths.STAGING_SUFFIX}"), "w").close()  # killed moving the pointer
    paths.prepare_staging(root, 3)  # killed writing iteration 3
    assert paths.find_checkpoint(root) == paths.iteration_dir(root, 1) + paths.REPLACED_SUFFIX
    paths.publish(root, 2)
    assert sorted(os.listdir(root)) == ["iter_0000002", paths.LATEST]
