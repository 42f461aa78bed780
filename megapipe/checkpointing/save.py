"""``Checkpointer.save``: every rank writes its own pieces in parallel; rank 0 publishes atomically.

Rank 0 prepares ``iter_N.tmp``; every rank writes its shards there through DCP. When DCP
returns on rank 0, every rank's files and the index are on disk and synced; rank 0 then adds
the run's tokenizer (``tokenizer_files``) and ``common.json`` and publishes (see
``paths.publish``). With ``--async-save`` the pieces are first copied to CPU memory and a
background thread writes and publishes them over a process group of its own while training
goes on; ``latest`` moves only once that write is complete. A save that fails (a full disk:
``space.py`` words it) removes its staging directory and raises the same ``CheckpointError`` on
every rank; whether the run stops is the trainer's choice (``--exit-on-save-failure``).
"""

from __future__ import annotations

import datetime
import os
import shutil
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

from megapipe.checkpointing.common import Common, SavedLayout, plain
from megapipe.checkpointing.load import load_checkpoint
from megapipe.checkpointing.paths import prepare_staging, publish, staging_dir
from megapipe.checkpointing.run_state import RunState
from megapipe.checkpointing.shards import Shard
from megapipe.checkpointing.space import Room
from megapipe.checkpointing.state import param_entries, precision_optimizers, save_shards
from megapipe.checkpointing.storage import write_shards
from megapipe.checkpointing.tokenizer_files import write_tokenizer
from megapipe.errors import CheckpointError


class Checkpointer:
    """Saves ``run`` as ``directory/iter_<iteration>`` and loads it back (collective over all ranks);
    owns the background writer of ``--async-save``, so that one save is in flight at a time."""

    def __init__(self, run: RunState):
        self.run = run
        self.writer: Optional[AsyncWriter] = None  # made by the first asynchronous save

    def save(self, directory: str) -> None:
        self.wait()  # one save in flight at a time, and its failure surfaces here
        started = time.perf_counter()
        with self.run.engine.whole_weights():  # optim_grads_params releases them between passes
            self._save(directory, started)

    def wait(self) -> None:
        """Block until an asynchronous save has published its checkpoint; raise if it failed."""
        if self.writer is not None:
            self.writer.wait()

    def load(self, directory: str) -> None:
        """``--load directory`` into the run (``load.load_checkpoint``)."""
        load_checkpoint(directory, self.run)

    def _save(self, directory: str, started: float) -> None:
        run = self.run
        t = run.config.training
        shards, common = training_state(run, with_optimizer=not t.no_save_optim)
        iteration = run.progress.iteration
        staging = staging_dir(directory, iteration)
        if run.ps.rank == 0:
            os.makedirs(directory, exist_ok=True)
            prepare_staging(directory, iteration)
        room = Room.measure(shards, directory)  # collective: the staging directory exists before any rank writes

        def finish() -> None:  # rank 0, once every rank's pieces are on disk (it may not be the logging rank)
            common.tokenizer = write_tokenizer(run.tokenizer, staging)
            common.write(staging)
            final = publish(directory, iteration)
            print(f"> saved checkpoint {final} at iteration {iteration} in {time.perf_counter() - started:.2f} s",
                  flush=True)

        def write(process_group) -> None:  # every rank, collective over process_group
            failure = None
            try:
                write_shards(written, staging, process_group=process_group)
                if run.ps.rank == 0:
                    finish()
            except (CheckpointError, OSError) as error:
                failure = _failure(error, room, iteration, staging)
                if run.ps.rank == 0:
                    shutil.rmtree(staging, ignore_errors=True)  # every rank stopped writing: DCP failed on all
            _agree(failure, process_group)

        if t.async_save:
            written = {key: _cpu_copy(shard) for key, shard in shards.items()}
            writer = self.writer = self.writer or AsyncWriter(run.timeout)
            writer.start(write)
            return
        written = shards
        write(None)


def training_state(run: RunState, with_optimizer: bool) -> tuple[dict[str, Shard], Common]:
    """This rank's pieces of the run's state and its JSON part (collective under a sharded optimizer, which
    gathers whole optimizer states). The pieces are views of the live tensors: copy before training goes on."""
    in_flight = run.engine.in_flight()  # PipeDream / 2BW between batches: kept, not drained
    entries = param_entries(run.chunks, run.engine.optimizer)
    shards = save_shards(entries, run.ps, run.config.model, run.device, with_optimizer=with_optimizer,
                         in_flight=None if in_flight is None else in_flight.to_tensors())
    return shards, _common(run, with_optimizer)


def _failure(error: BaseException, room: Room, iteration: int, staging: str) -> str:
    """The sentence for a failed save: the disk space it lacked, or the error's own."""
    if room.ran_out(error, staging):
        return room.sentence(iteration, staging)
    if isinstance(error, CheckpointError):
        return str(error)
    return f"saving the checkpoint of iteration {iteration} into {staging} failed: {error}."


def _agree(failure: Optional[str], process_group) -> None:
    """Raise the save's failure on every rank: rank 0's sentence (it publishes, so its view is the
    whole one), else this rank's own."""
    agreed = [failure]
    dist.broadcast_object_list(agreed, src=0, group=process_group)
    if agreed[0] is not None or failure is not None:
        raise CheckpointError(agreed[0] or failure)


def _common(run: RunState, with_optimizer: bool) -> Common:
    scaler = precision_optimizers(run.engine.optimizer)[0].loss_scaler  # one scale for all chunks
    return Common(kind=run.kind, iteration=run.progress.iteration,
                  consumed_samples=run.progress.consumed_samples,
                  skipped_iterations=run.progress.skipped_iterations, layout=SavedLayout.of_run(run),
                  config=plain(run.config), scheduler=run.scheduler.state_dict(),
                  loss_scaler=scaler.state_dict() if scaler is not None else None,
                  has_optimizer=with_optimizer, has_rng=True)


def _cpu_copy(shard: Shard) -> Shard:
    return Shard(shard.local.detach().to("cpu", copy=True), shard.global_shape, shard.offsets)


class AsyncWriter:
    """Writes staged CPU copies on a background thread over a process group of its own.

    The group keeps the writer's collectives apart from training's; it is created on the
    first asynchronous save, which every rank reaches at the same iteration, with the job's timeout
    (a write left waiting for a lost peer then fails within it instead of holding the exit).
    """

    def __init__(self, timeout: datetime.timedelta):
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def start(self, write: Callable[[object], None]) -> None:
        """Run ``write(group)`` (collective over the writer's group) on the background thread."""
        def run() -> None:
            try:
                write(self.group)
            except BaseException as error:  # reported by wait() on the training thread
                self.error = error

        self.thread = threading.Thread(target=run, name="megapipe-async-save", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is None:
            return
        self.thread.join()
        self.thread, error, self.error = None, self.error, None
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"the asynchronous checkpoint save failed: {error}") from error
