"""The training loop's side of ``--fault-tolerant-replicas``: agree before each step, discard a step a loss broke.

Before each step ``before_step`` asks for the quorum (``replicas/group.py``); when it is new, the members
behind receive the state, and every member resizes its share of the global batch: with w replicas alive and
d data-parallel ranks in each, a rank reads slice ``index x d + its d-rank`` of ``w x d`` and runs
``global batch / (micro batch x d x w)`` microbatches, which is the arithmetic of a run started at
d x w ranks, so the losses equal that run's. A step during which a replica is lost is *discarded*, not
finished: the survivors' gradients lack the lost replica's share of the batch, and finishing it would
mean computing that share again, the same work as running the step again at the new width, which also
keeps the run's trajectory that of a run switched to the new width at that step. Its random state comes
back, its gradients are cleared, and the step runs again once the quorum is new.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional

from megapipe.checkpointing.common import SavedLayout
from megapipe.checkpointing.load import load_state
from megapipe.checkpointing.peer_memory import decode, encode, metadata_of, fill_from
from megapipe.checkpointing.save import training_state
from megapipe.parallel.random import capture_rng, restore_rng
from megapipe.replicas.group import ReplicaGroup, ReplicaLost


class ReplicaSteps:
    """Keeps one rank of a replica in step with the quorum (module docstring)."""

    def __init__(self, trainer):
        t = trainer.config.training
        self.trainer, self.replicas = trainer, t.fault_tolerant_replicas
        model = trainer.config.model
        fingerprint = (f"layout {SavedLayout.of(trainer.ps)}, schedule {trainer.engine.schedule.name}, "
                       f"{model.num_layers} layers of {model.hidden_size}, sequences of {model.seq_length}, "
                       f"vocabulary {trainer.tokenizer.vocab_size}, global batch {t.global_batch_size} in "
                       f"microbatches of {t.micro_batch_size}, {t.train_iters} iterations")
        self.group = ReplicaGroup(t.lighthouse, t.replica_id, trainer.ps.rank, trainer.ps.world_size, trainer.device,
                                  t.replica_timeout_seconds, fingerprint)
        trainer.engine.replica_sync = self._average
        self.step_losses = None  # the last step's loss sums (``Trainer.loss_sums``), summed over the quorum
        self.width: Optional[int] = None  # replicas the batch is split over now; None: not yet resized
        self.members: tuple[int, ...] = ()
        self.lost_at: Optional[float] = None  # when the last discarded step failed
        self._rng = None

    @property
    def saves(self) -> bool:
        """Whether this replica writes the disk checkpoints: the first member of the quorum (one writer per job)."""
        quorum = self.group.quorum
        return quorum is None or quorum.members[0] == self.group.replica

    def before_step(self, batches: Iterator[list[dict]]) -> Iterator[list[dict]]:
        """Agree on the quorum (healing and resizing when it is new); the batches to train on."""
        trainer = self.trainer
        while True:
            try:
                quorum = self.group.agree(trainer.state.iteration)
                healed = self.group.heal(self._encode_state, self._load_state)
                break
            except ReplicaLost as lost:
                trainer.logger.print(f"> replicas: {lost}; asking the lighthouse for a new quorum")
                self.lost_at = self.lost_at or time.monotonic()
        if healed is not None:
            sources = quorum.members[quorum.source]
            trainer.logger.print(f"> replicas: replica(s) {list(quorum.behind)} received the state of iteration "
                                 f"{quorum.newest} from replica {sources} in {healed:.2f} s")
        if self.width != quorum.width or self.members != quorum.members or healed is not None:
            batches = self._resize(quorum)
        self._rng = capture_rng(trainer.ps.rng_tracker, trainer.device)
        return batches

    def _resize(self, quorum) -> Iterator[list[dict]]:
        trainer, ps = self.trainer, self.trainer.ps
        t = trainer.config.training
        previous = self.members
        self.width, self.members = quorum.width, quorum.members
        m = t.global_batch_size // (t.micro_batch_size * ps.dp_size * quorum.width)
        index = quorum.index(self.group.replica) * ps.dp_size + ps.dp_rank
        trainer.m = m
        trainer.engine.use_microbatches(m)
        trainer.batches.share(m, (index, quorum.width * ps.dp_size))
        lost, joined = sorted(set(previous) - set(quorum.members)), sorted(set(quorum.members) - set(previous))
        change = ", ".join(filter(None, [f"replica(s) {lost} lost" if lost and previous else "",
                                         f"replica(s) {joined} joined" if joined and previous else ""]))
        resumed = (f"; resumed {time.monotonic() - self.lost_at:.1f} s after the failure was seen"
                   if self.lost_at is not None else "")
        trainer.logger.print(f"> replicas: {change or 'quorum'} at iteration {trainer.state.iteration + 1}: replicas "
                             f"{list(quorum.members)} ({quorum.width} of {self.replicas}) train the global batch of "
                             f"{t.global_batch_size}, {m} microbatch(es) per rank{resumed}")
        self.lost_at = None
        return trainer.batches.batches("train", trainer.state.consumed_samples)

    def discard(self, lost: ReplicaLost) -> None:
        """The step that raised ``lost`` is dropped: random state back, gradients cleared, executors made anew."""
        trainer = self.trainer
        self.lost_at = time.monotonic()
        trainer.logger.print(f"> replicas: {lost}; the step of iteration {trainer.state.iteration + 1} is discarded "
                             "and runs again with the replicas that are left")
        restore_rng(self._rng, trainer.ps.rng_tracker, trainer.device)
        trainer.engine.discard_step()
        self.width = None  # resized (executors and batches anew) before the next step

    def _average(self, grads) -> None:
        """The engine's hook before each step: the gradients averaged and the step's losses summed over the
        quorum under one vote, so that a replica lost after it cannot leave a logged loss short of its share."""
        self.step_losses = self.trainer.loss_sums(self.trainer.engine.executor.losses_so_far())
        self.group.reduce(grads, [self.step_losses])

    def sum_(self, totals) -> bool:
        return self.group.sum_(totals)

    def _encode_state(self) -> bytes:
        run = self.trainer.run_state
        with run.engine.whole_weights():
            shards, common = training_state(run, with_optimizer=True)
            return encode(shards, common)

    def _load_state(self, payload: bytes) -> None:
        started = time.perf_counter()
        shards, common = decode(payload, "the state sent by a live replica")
        load_state(f"the state of iteration {common.iteration} sent by a live replica", common,
                   {key: metadata_of(shard) for key, shard in shards.items()}, self.trainer.run_state,
                   lambda wanted: fill_from(wanted, shards), started)

    def close(self) -> None:
        self.group.close()
