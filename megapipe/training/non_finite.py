"""``--check-for-nan-in-loss-and-grad``: the iterations whose loss or gradient norm was NaN or Inf.

Megatron-LM raises at once on a NaN loss or gradient, a host read per microbatch. Here the check
stays off the hot path: each iteration folds its verdict into a few device numbers (how many
iterations went bad, the first and the last, and what the first saw) from values the step already
computed: the loss of each microbatch on the last stage, and the gradient norm the optimizer reduced
over every rank. They are read with the step counters, where the loop already reads the device (each
log interval and each save), and gathered from every rank there (one small collective, only with the
flag), so that every rank names the same first iteration and the rank that saw it (a loss before a
gradient norm: the loss is where a NaN shows first) and stops at the same point. The update of a bad
iteration never happens: the optimizer skips a non-finite gradient norm on every rank, and a
non-finite loss is made one (``optim/non_finite.py``). So between the bad iteration and the read the
weights stay as they were; then ``stop`` raises ``NonFiniteError`` (exit status 2, one sentence,
before any checkpoint is written) and ``skip`` logs the same sentence and goes on. fp16's overflows
are the loss scaler's business, not counted here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megapipe.errors import NonFiniteError

LOSS, GRAD = 1, 2  # what an iteration saw, as bits
WHAT = {LOSS: "loss", GRAD: "gradient norm", LOSS | GRAD: "loss and gradient norm"}


class NonFiniteWatch:
    """This rank's bad iterations since the last read, on the device: [first, what the first saw, last]."""

    NONE = 1 << 62  # ``first`` while no iteration went bad

    def __init__(self, device: torch.device, action: str):
        self.action = action
        self._state = torch.tensor([self.NONE, 0, 0], dtype=torch.int64, device=device)

    def note_losses(self, iteration: int, losses: list) -> None:
        """The microbatch losses of ``iteration`` (on the last stage; none elsewhere)."""
        if losses:
            self._note(iteration, LOSS * (~torch.isfinite(torch.stack(losses))).any().long())

    def note_step(self, iteration: int, step) -> None:
        """The optimizer step of ``iteration`` (None: this rank ran none)."""
        if step is not None:
            self._note(iteration, GRAD * (~torch.isfinite(step.norm) & ~step.overflow_flag).long())

    def _note(self, iteration: int, bits: torch.Tensor) -> None:
        """Fold one verdict in (the loss's and the step's of one iteration may come in either order)."""
        first, first_bits, last = self._state.unbind()
        bad = bits > 0
        earlier = bad & (iteration < first)
        same = bad & (iteration == first)
        self._state = torch.stack([torch.where(earlier, iteration, first),
                                   torch.where(earlier, bits, torch.where(same, first_bits | bits, first_bits)),
                                   torch.where(bad, torch.clamp(last, min=iteration), last)])

    def read(self) -> Optional[str]:
        """The sentence about the bad iterations of every rank since the last read (None if none), the same on
        every rank; raised under ``stop``. Collective over all ranks."""
        rows = [torch.empty_like(self._state) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, self._state)
        seen = [(first, -(bits & LOSS), rank, bits, last)
                for rank, (first, bits, last) in enumerate(torch.stack(rows).tolist()) if first != self.NONE]
        if not seen:
            return None
        self._state = torch.tensor([self.NONE, 0, 0], dtype=torch.int64, device=self._state.device)
        first, _, rank, bits, _ = min(seen)
        last = max(row[4] for row in seen)
        again = f" (and again up to iteration {last})" if last > first else ""
        found = f"rank {rank} found a NaN/Inf {WHAT[bits]} at iteration {first}{again}"
        if self.action == "stop":
            raise NonFiniteError(f"{found}; stopping as --check-for-nan-in-loss-and-grad asks, with the update of "
                                 "each such iteration skipped: lower --lr, check the data or resume from an earlier "
                                 "checkpoint (--non-finite-action skip trains on, skipping such updates).")
        return f"{found}; skipped the update of each such iteration (--non-finite-action skip)."
