"""Optimizer post-validation: step each stage eagerly, check afterwards, roll back when needed.

A synchronous step all-reduces the squared gradient norm and the overflow flag over every
pipeline stage before any stage may update, so all stages meet at the end of every iteration
and a zero-bubble schedule's parallelogram cannot run on into the next one. Qi et al. (Zero
Bubble Pipeline Parallelism, ICLR 2024, "Bypassing optimizer synchronizations") replace that
with a validation after the update, and so does this module:

* At its STEP each stage reduces its state (squared norm, overflow flag) over its own tensor
  (and, sharded, data-parallel) ranks, receives the *partial* state of the stages before it
  from the previous pipeline rank, adds its own and passes the sum on (``_chain``). It steps at
  once under that partial state: skip if a non-finite value is already seen, clip by the
  partial norm, update the loss scale from the partial flag. Before that it copies what the step
  changes (``OptimizerBackup``).
* The last stage holds the full state. It decides whether any stage needs an amendment: a
  non-finite value anywhere, or a norm whose clipping coefficient could be below 1 (conservative
  by ``AMEND_MARGIN``, far above the rounding of a sum of p terms, so a step the synchronous
  run would clip is never missed; a needless amendment recomputes the same values). It sends
  the verdict and the full state straight to every pipeline rank on a communicator of its own.
* Each rank reads the verdict at its next STEP (``settle``; the message was sent at the last
  stage's previous STEP, which causally precedes the backward this rank just ran, so it has
  arrived). That is the one host read per iteration. When no amendment is needed the eager
  step was the synchronous step bit for bit: the partial norm is at most the full one, so
  neither clips, and no value was non-finite. Otherwise every rank restores the backup and takes
  the step again as the synchronous step does (``redo``), on the same gradients; the engine then
  runs the iteration whose forwards used the eager weights once more (``engine.py``).

Memory: the backup holds, per rank, a copy of the finalized main gradients, the fp32 main
weights and the optimizer state (AdamW: two moments; SGD: the momentum), all of this rank's
shard when the optimizer is sharded.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.optim.clip import CLIP_EPSILON
from megapipe.optim.precision import PrecisionOptimizer, StepResult
from megapipe.parallel.state import ParallelState

AMEND_MARGIN = 1e-4  # relative: amend when (norm + eps) (1 + margin) exceeds --clip-grad


class OptimizerBackup:
    """What one optimizer step changes, copied before an eager step so it can be taken back: the
    finalized main gradients (the step unscales and clips them in place), the main weights, the
    optimizer state, the param groups' hyperparameters and the loss scaler's counters."""

    def __init__(self, optimizer: PrecisionOptimizer):
        self.optimizer = optimizer
        self._grads: list[torch.Tensor] = []
        self._mains: list[torch.Tensor] = []
        self._state: list[Optional[dict]] = []  # per main param; None: it had no state yet
        self._hyper: list[dict] = []
        self._scaler: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def save(self) -> None:
        opt = self.optimizer
        if not self._grads:
            self._grads = [grad.clone() for grad in opt.main_grads]
            self._mains = [main.detach().clone() for main in opt.main_params]
        else:
            torch._foreach_copy_(self._grads, opt.main_grads)
            torch._foreach_copy_(self._mains, [main.detach() for main in opt.main_params])
        previous = self._state or [None] * len(opt.main_params)
        self._state = [_copy_state(opt.inner.state.get(main), into) for main, into in zip(opt.main_params, previous)]
        self._hyper = [{key: value for key, value in group.items() if key != "params"}
                       for group in opt.inner.param_groups]
        scaler = vars(opt.loss_scaler) if opt.loss_scaler is not None else {}
        self._scaler = {name: value.clone() for name, value in scaler.items() if isinstance(value, torch.Tensor)}

    @torch.no_grad()
    def restore(self) -> list[dict]:
        """Put everything back as ``save`` found it (the gradients into the main-gradient buffers),
        except the model's own copies of low-precision or sharded weights, which the redone step
        rewrites; returns the hyperparameters in force before, for ``reinstate``."""
        opt = self.optimizer
        torch._foreach_copy_(opt.main_grads, self._grads)
        torch._foreach_copy_([main.detach() for main in opt.main_params], self._mains)
        for main, saved in zip(opt.main_params, self._state):
            if saved is None:
                opt.inner.state.pop(main, None)
            else:
                opt.inner.state[main] = _copy_state(saved, opt.inner.state.get(main))
        current = [{key: value for key, value in group.items() if key != "params"} for group in opt.inner.param_groups]
        self.reinstate(self._hyper)
        for name, value in self._scaler.items():
            setattr(opt.loss_scaler, name, value.clone())
        return current  # the model's weights follow the main weights at the step that redoes this one

    def reinstate(self, hyperparameters: list[dict]) -> None:
        for group, values in zip(self.optimizer.inner.param_groups, hyperparameters):
            group.update(values)


def _copy_state(state: Optional[dict], into: Optional[dict] = None) -> Optional[dict]:
    """A copy of one parameter's optimizer state, written into ``into``'s tensors when it has the
    same entries (no allocation per step), else new ones; None for no state."""
    if not state:
        return None
    if not into or into.keys() != state.keys():
        return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in state.items()}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            into[name].copy_(value)
        else:
            into[name] = value
    return into


class PostValidation:
    """One rank's eager steps and their validation (module docstring), for one optimizer over all
    this rank's chunks (flush schedules). ``rollbacks`` counts the steps taken back."""

    def __init__(self, optimizer: PrecisionOptimizer, ps: ParallelState,
                 timeout: Optional[datetime.timedelta] = None):
        self.optimizer, self.ps = optimizer, ps
        self.group = ps.pipeline_side_group("post-validation", timeout)
        self.backup = OptimizerBackup(optimizer)
        self.rollbacks = 0
        self._verdict: Optional[torch.Tensor] = None  # [amend, squared norm, overflow] of the last eager step
        self._verdict_work = None
        self._sends: list = []

    @property
    def _last(self) -> bool:
        """The last pipeline rank (in rank order, whichever stages it holds) gathers the full state."""
        return self.ps.pp_rank == self.ps.pp_size - 1

    @property
    def pending(self) -> bool:
        """An eager step has not been validated yet."""
        return self._verdict is not None

    def step(self) -> StepResult:
        """Back up, then step under the partial state of the stages up to this one."""
        if self.pending:
            raise RuntimeError("settle() the previous eager step before the next one")
        self.backup.save()
        result = self.optimizer.step(chain=self._chain)
        if not self._last:
            self._verdict = torch.empty(3, dtype=torch.float32, device=result.norm.device)
            self._verdict_work = dist.irecv(self._verdict, self.ps.stage_rank(self.ps.pp_size - 1), group=self.group)
        return result

    def settle(self) -> tuple[bool, Optional[StepResult]]:
        """Wait for the verdict on the last eager step: (whether it must be redone, its outcome
        under the full state; None when nothing was pending). Reads one flag on the host."""
        if not self.pending:
            return False, None
        if self._verdict_work is not None:
            self._verdict_work.wait()
        for work in self._sends:
            work.wait()
        verdict, self._verdict, self._verdict_work, self._sends = self._verdict, None, None, []
        amend = bool(verdict[0])
        if amend:
            self.rollbacks += 1
        overflow = verdict[2] > 0
        if self.optimizer.loss_scaler is None:  # as the synchronous step: a non-finite norm alone, no overflow
            overflow = torch.zeros_like(overflow)
        norm = verdict[1].sqrt()
        return amend, StepResult(overflow | ~torch.isfinite(norm), norm, overflow)

    def redo(self) -> StepResult:
        """Take the last eager step back and take it again as the synchronous step does (all
        ranks call this together, after ``settle`` said so)."""
        current = self.backup.restore()
        result = self.optimizer.step()
        self.backup.reinstate(current)
        return result

    # ---- the partial state, stage to stage --------------------------------------------------
    def _chain(self, found: Optional[torch.Tensor], squared: torch.Tensor):
        """This stage's (overflow flag, squared norm) -> those of the stages up to this one."""
        flag = found[0] if found is not None else torch.zeros_like(squared)
        state = torch.stack([squared, flag])
        if self.ps.pp_rank > 0:
            before = torch.empty_like(state)
            dist.irecv(before, self.ps.prev_rank, group=self.group).wait()
            state = before + state
        if self._last:
            self._announce(state)
        else:
            self._sends.append(dist.isend(state, self.ps.next_rank, group=self.group))
        return (state[1:] if found is not None else None), state[0]

    def _announce(self, state: torch.Tensor) -> None:
        """Last rank: decide from the full state whether any stage must redo its step, and tell every rank."""
        squared, flag = state[0], state[1]
        amend = ~torch.isfinite(squared) | (flag > 0)
        clip = self.optimizer.clip_grad
        if clip > 0:
            amend = amend | ((squared.sqrt() + CLIP_EPSILON) * (1 + AMEND_MARGIN) > clip)
        self._verdict = torch.stack([amend.float(), squared, flag])
        self._sends += [dist.isend(self._verdict, self.ps.stage_rank(r), group=self.group)
                        for r in range(self.ps.pp_size - 1)]
