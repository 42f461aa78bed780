"""Peer-memory checkpoints (``--local-checkpoint-interval N``): a relaunch after a host loss resumes from
copies held in the memory of the hosts that survived, without reading the disk checkpoint.

Every N iterations each rank copies its pieces of the training state to the CPU (the pieces and JSON
part of a disk checkpoint, ``save.training_state``); a background thread serialises them, writes them
into this host's directory (``--local-checkpoint-dir``, memory-backed by default) and sends them to its
*partner*, the rank ``LOCAL_WORLD_SIZE`` further on (on the next host), which writes them into its own
host's directory. Every rank's state then lives on two hosts, and one host lost leaves a copy of each.
Every file carries the SHA-256 of its bytes; a file is written under a temporary name and renamed.

On a relaunch with ``--load`` every rank reads the copies its process left on this host, checking each
checksum, and the ranks agree (``choose``) on the newest iteration of which every rank's state has a good
copy somewhere, when it is not older than the disk checkpoint; each rank then takes its own copy, or
receives the one a peer holds. Damaged copies, copies of another layout and incomplete iterations are
passed over and named; without a complete set the disk checkpoint loads, as without this flag.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import socket
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.checkpointing.common import Common, SavedLayout
from megapipe.checkpointing.load import load_state, open_checkpoint
from megapipe.checkpointing.paths import read_latest
from megapipe.checkpointing.run_state import RunState
from megapipe.checkpointing.save import training_state
from megapipe.checkpointing.shards import Shard
from megapipe.checkpointing.storage import read_shards
from megapipe.errors import CheckpointError

NAME = re.compile(r"iter_(\d{7})_rank_(\d{5})\.bin")


@dataclasses.dataclass(frozen=True)
class Held:
    """A copy of ``owner``'s state at ``iteration`` that rank ``holder`` (on ``host``) read on this host;
    ``problem`` says why it cannot be used, or is None."""

    owner: int
    iteration: int
    holder: int
    host: str
    size: int
    digest: str
    layout: str
    problem: Optional[str] = None


def choose(held: list[Held], world_size: int, layout: str,
           disk_iteration: Optional[int]) -> tuple[Optional[int], dict[int, Held], list[str]]:
    """The iteration to restore (None: load the disk checkpoint), the copy each rank takes (its own where
    good; a rank without one at the disk checkpoint's iteration reads that), and one sentence per copy or
    iteration passed over."""
    notes, usable = [], []
    for copy in held:
        problem = copy.problem or (None if copy.layout == layout else
                                   f"was written with {copy.layout}, not this run's {layout}")
        if problem is None:
            usable.append(copy)
        else:
            notes.append(f"the copy of rank {copy.owner}'s state at iteration {copy.iteration} held by rank "
                         f"{copy.holder} ({copy.host}) {problem}: not used")
    for iteration in sorted({copy.iteration for copy in usable}, reverse=True):
        if disk_iteration is not None and iteration < disk_iteration:
            break
        copies: dict[int, Held] = {}
        for copy in sorted((c for c in usable if c.iteration == iteration), key=lambda c: (c.holder != c.owner,
                                                                                          c.holder)):
            copies.setdefault(copy.owner, copy)
        missing = [rank for rank in range(world_size) if rank not in copies]
        if not missing:
            return iteration, copies, notes
        ranks = ", ".join(map(str, missing))
        if iteration == disk_iteration and copies:  # what no peer holds comes from the disk, the rest from memory
            return iteration, copies, notes + [f"no good copy of the state of rank(s) {ranks} at iteration "
                                               f"{iteration}: read from the disk checkpoint of that iteration"]
        notes.append(f"iteration {iteration} is incomplete: no good copy of the state of rank(s) {ranks}")
    return None, {}, notes


def encode(shards: dict[str, Shard], common: Common) -> bytes:
    """One rank's state as bytes (the pieces as they are: already copies, ``PeerCheckpoints.save``)."""
    buffer = io.BytesIO()
    torch.save({"common": dataclasses.asdict(common),
                "shards": {key: (s.local, list(s.global_shape), list(s.offsets)) for key, s in shards.items()}},
               buffer)
    return buffer.getvalue()


def decode(payload: bytes, where: str) -> tuple[dict[str, Shard], Common]:
    """``encode``'s value back (tensors only: nothing in the bytes can run code)."""
    value = torch.load(io.BytesIO(payload), weights_only=True)
    shards = {key: Shard(local, tuple(shape), tuple(offsets)) for key, (local, shape, offsets) in value["shards"].items()}
    return shards, Common.from_fields(value["common"], where)


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def write_copy(directory: str, owner: int, iteration: int, layout: str, payload: bytes) -> None:
    """``payload`` as this host's copy of ``owner``'s state: a JSON header line, then the bytes; atomic."""
    os.makedirs(directory, exist_ok=True)
    header = {"owner": owner, "iteration": iteration, "layout": layout, "size": len(payload),
              "sha256": digest(payload)}
    path = os.path.join(directory, f"iter_{iteration:07d}_rank_{owner:05d}.bin")
    with open(path + ".tmp", "wb") as f:
        f.write(json.dumps(header).encode() + b"\n")
        f.write(payload)
    os.replace(path + ".tmp", path)


def read_copies(directory: str, holder: int) -> tuple[list[Held], dict[tuple[int, int], bytes]]:
    """The copies in ``directory``, each checked against its checksum, and the bytes of the good ones by
    (owner, iteration)."""
    held, payloads, host = [], {}, socket.gethostname()
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        match = NAME.fullmatch(name)
        if match is None:
            continue
        owner, iteration = int(match[2]), int(match[1])
        with open(os.path.join(directory, name), "rb") as f:
            line, payload = f.readline(), f.read()
        try:
            header = json.loads(line)
        except ValueError:
            held.append(Held(owner, iteration, holder, host, 0, "", "", "has a damaged header"))
            continue
        problem = None
        if len(payload) != header["size"]:
            problem = f"is cut short ({len(payload)} of {header['size']} bytes)"
        elif digest(payload) != header["sha256"]:
            problem = "fails its checksum"
        held.append(Held(owner, iteration, holder, host, header["size"], header["sha256"], header["layout"], problem))
        if problem is None:
            payloads[(owner, iteration)] = payload
    return held, payloads


def prune(directory: str, keep: set[int]) -> None:
    """Remove this directory's copies of iterations not in ``keep``."""
    for name in os.listdir(directory):
        match = NAME.fullmatch(name)
        if match is not None and int(match[1]) not in keep:
            os.remove(os.path.join(directory, name))


def exchange(payload: bytes, partner: int, source: int, group=None) -> bytes:
    """Send ``payload`` to rank ``partner`` and receive the bytes rank ``source`` sends (sizes first)."""
    size, incoming_size = torch.tensor([len(payload)]), torch.zeros(1, dtype=torch.int64)
    for work in (dist.isend(size, partner, group), dist.irecv(incoming_size, source, group)):
        work.wait()
    incoming = torch.empty(int(incoming_size), dtype=torch.uint8)
    outgoing = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    for work in (dist.isend(outgoing, partner, group), dist.irecv(incoming, source, group)):
        work.wait()
    return incoming.numpy().tobytes()


class PeerCheckpoints:
    """One rank's peer-memory checkpoints: ``save`` every N iterations, ``restore`` once at the start."""

    def __init__(self, run: RunState, directory: str, ranks_per_host: int):
        self.run = run
        self.directory = os.path.join(directory, f"local_rank_{int(os.environ.get('LOCAL_RANK', '0'))}")
        world, rank = run.ps.world_size, run.ps.rank
        self.partner, self.source = (rank + ranks_per_host) % world, (rank - ranks_per_host) % world
        self.group = None  # the background exchange's own process group, made at the first save
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.saved: list[int] = []  # iterations whose copies this rank wrote, oldest first

    @property
    def layout(self) -> str:
        return str(SavedLayout.of_run(self.run))

    def save(self) -> None:
        """Copy this rank's state now (collective under a sharded optimizer); write and exchange it behind
        training. The previous save's failure, if any, is raised here."""
        self.wait()
        with self.run.engine.whole_weights():
            shards, common = training_state(self.run, with_optimizer=True)
            shards = {key: Shard(s.local.detach().to("cpu", copy=True), s.global_shape, s.offsets)
                      for key, s in shards.items()}
        if self.group is None and self.partner != self.run.ps.rank:
            self.group = dist.new_group(backend="gloo", timeout=self.run.timeout)
        iteration, layout = common.iteration, self.layout

        def write() -> None:
            payload = encode(shards, common)
            write_copy(self.directory, self.run.ps.rank, iteration, layout, payload)
            if self.partner != self.run.ps.rank:
                write_copy(self.directory, self.source, iteration, layout,
                           exchange(payload, self.partner, self.source, self.group))
            self.saved = (self.saved + [iteration])[-2:]  # the one before stays until this one is whole everywhere
            prune(self.directory, set(self.saved))

        def run() -> None:
            try:
                write()
            except BaseException as error:  # reported by wait() on the training thread
                self.error = error

        self.thread = threading.Thread(target=run, name="megapipe-peer-checkpoint", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Block until the last save's copies are written here and at the partner; raise if that failed."""
        if self.thread is not None:
            self.thread.join()
        self.thread, error, self.error = None, self.error, None
        if error is not None:
            raise CheckpointError(f"keeping the peer-memory checkpoint in {self.directory} failed: {error}") from error

    def restore(self, directory: str) -> bool:
        """Load the newest complete set of copies not older than the disk checkpoint in ``directory`` (``--load``;
        at that checkpoint's iteration, a rank no copy is left of reads its own state from it) and return True,
        or return False, having said why, for the disk to load (collective)."""
        started = time.perf_counter()
        ps = self.run.ps
        disk_iteration = read_latest(directory) if os.path.isdir(directory) else None
        held, payloads = read_copies(self.directory, ps.rank)
        everyone: list = [None] * ps.world_size
        dist.all_gather_object(everyone, held)
        iteration, sources, notes = choose([c for copies in everyone for c in copies], ps.world_size, self.layout,
                                           disk_iteration)
        for note in notes:
            self.run.log(f"> peer-memory checkpoint: {note}")
        if iteration is None:
            if notes:
                on_disk = "none" if disk_iteration is None else f"iteration {disk_iteration}"
                self.run.log(f"> the peer-memory copies hold no complete iteration as new as the disk checkpoint "
                             f"({on_disk}), which loads instead")
            return False
        from_peers = [f"rank {owner}'s from rank {copy.holder} ({copy.host})" for owner, copy in sorted(sources.items())
                      if copy.holder != owner]
        from_peers += [f"rank {rank}'s from the disk" for rank in range(ps.world_size) if rank not in sources]
        self.run.log(f"> restoring iteration {iteration} from peer memory (the disk checkpoint holds "
                     f"{'none' if disk_iteration is None else disk_iteration}): every rank's state from its own host"
                     + (f" but {', '.join(from_peers)}" if from_peers else ""))
        mine = sources.get(ps.rank)
        works, incoming = [], None
        for owner, copy in sources.items():
            if copy.holder == ps.rank and owner != ps.rank:
                works.append(dist.isend(torch.frombuffer(bytearray(payloads[(owner, iteration)]), dtype=torch.uint8),
                                        owner))
        if mine is not None and mine.holder != ps.rank:
            incoming = torch.empty(mine.size, dtype=torch.uint8)
            works.append(dist.irecv(incoming, mine.holder))
        for work in works:
            work.wait()
        if mine is None:
            return self._read_own_from_disk(directory, started)
        payload = payloads[(ps.rank, iteration)] if incoming is None else incoming.numpy().tobytes()
        damaged: list = [None] * ps.world_size
        dist.all_gather_object(damaged, digest(payload) != mine.digest)
        if any(damaged):  # on the way: every rank falls back together (disk readers see it in the same gather)
            self.run.log(f"> peer-memory checkpoint: the state of rank(s) {[r for r, bad in enumerate(damaged) if bad]} "
                         f"at iteration {iteration} arrived damaged (its checksum differs): the disk checkpoint loads")
            return False
        shards, common = decode(payload, f"the peer-memory copy of rank {ps.rank} at iteration {iteration}")
        saved = {key: metadata_of(shard) for key, shard in shards.items()}
        load_state(f"the peer-memory checkpoint of iteration {iteration}", common, saved, self.run,
                   lambda wanted: fill_from(wanted, shards), started)
        self.saved = [iteration]
        return True

    def _read_own_from_disk(self, directory: str, started: float) -> bool:
        """This rank's state from the disk checkpoint, read without the other ranks (which load their copies)."""
        damaged: list = [None] * self.run.ps.world_size
        dist.all_gather_object(damaged, False)
        if any(damaged):
            return False
        path, common, saved = open_checkpoint(directory, self.run.kind)
        load_state(f"the peer-memory checkpoint of iteration {common.iteration} (this rank's state from {path})",
                   common, saved, self.run, lambda wanted: read_shards(wanted, path, no_dist=True), started)
        self.saved = [common.iteration]
        return True


def metadata_of(shard: Shard):
    """What a DCP index says of the tensor ``shard`` belongs to (its global size and dtype)."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    return TensorStorageMetadata(TensorProperties(dtype=shard.local.dtype), torch.Size(shard.global_shape), [])


def fill_from(wanted: dict[str, Shard], held: dict[str, Shard]) -> None:
    """Copy the held pieces (a rank's whole state, ``decode``) into the blocks a load asks for: the same layout,
    so the same keys and offsets."""
    for key, target in wanted.items():
        piece = held.get(key)
        if piece is None or piece.offsets != target.offsets or piece.local.shape != target.local.shape:
            raise CheckpointError(f"the state copied from a peer lacks {key} at offsets {target.offsets}: it was "
                                  "written with another layout; relaunch to load the disk checkpoint.")
        target.local.copy_(piece.local)
