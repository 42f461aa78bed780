"""Runs one pipeline rank's action list for real: forward, backward, messages, step.

The executor knows nothing about which schedule it runs; the list says everything (see
``actions.py`` for each kind's meaning and the posting contract). Activations are released
as soon as the schedule allows: a sent output after its send completes, a stage's saved
input and output after its backward.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megapipe.parallel_state import ParallelState
from megapipe.pipeline.actions import Action, ActionKind, Schedule
from megapipe.pipeline.p2p import StageP2P, Transfer
from megapipe.pipeline.timeline import Timeline


@dataclass
class BatchResult:
    """What one batch produced on this rank: per-microbatch losses (last stage only)."""

    losses: list[float]
    peak_in_flight: int  # most microbatch activations held at once, summed over this rank's chunks


class PipelineExecutor:
    """Executes ``schedule.actions[pp_rank]`` over this rank's model chunks.

    ``step`` is called for STEP (after the flush): it finalises gradients and updates
    weights. ``scale_loss`` turns a microbatch loss into the tensor to differentiate (for
    example times a loss scale); the executor itself divides by the number of microbatches,
    so the accumulated gradient is that of the mean loss.
    """

    def __init__(self, chunks: list[torch.nn.Module], ps: ParallelState, schedule: Schedule,
                 boundary_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 step: Callable[[], object], scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                 scatter_gather: bool = True, timeout: datetime.timedelta = datetime.timedelta(seconds=300),
                 timeline: Optional[Timeline] = None):
        if schedule.p != ps.pp_size or schedule.v != len(chunks):
            raise ValueError(f"schedule for p={schedule.p}, v={schedule.v} given to a rank with "
                             f"p={ps.pp_size} and {len(chunks)} model chunks")
        self.chunks, self.ps, self.schedule = chunks, ps, schedule
        self.step, self.scale_loss, self.timeline = step, scale_loss, timeline
        self.p2p = StageP2P(ps, boundary_shape, dtype, device, scatter_gather, timeout)
        self.actions = schedule.actions[ps.pp_rank]

    def run(self, microbatches: list[dict]) -> BatchResult:
        """Run one batch of ``schedule.m`` microbatches (each a dict of tensors)."""
        if len(microbatches) != self.schedule.m:
            raise ValueError(f"schedule expects {self.schedule.m} microbatches, got {len(microbatches)}")
        state = _BatchState()
        actions, i = self.actions, 0
        while i < len(actions):
            if actions[i].kind.is_communication:
                j = i
                while j < len(actions) and actions[j].kind.is_communication:
                    j += 1
                self._post(actions[i:j], state)
                i = j
                continue
            self._wait_for_inputs(actions[i], state)
            start = time.time()
            self._compute(actions[i], microbatches, state)
            if self.timeline is not None:
                self.timeline.record(self.ps.pp_rank, actions[i], start, time.time())
            i += 1
        for transfer in state.sends:
            self.p2p.wait(transfer)
        return BatchResult([loss.item() for loss in state.losses], state.peak_in_flight)

    # ---- communication --------------------------------------------------------------------------
    def _post(self, actions: list[Action], state: "_BatchState") -> None:
        items = []
        for action in actions:
            key = (action.stage, action.microbatch)
            if action.kind is ActionKind.SEND_F:
                items.append((action, state.outputs_to_send.pop(key)))
            elif action.kind is ActionKind.SEND_B:
                items.append((action, state.input_grads.pop(key)))
            else:
                items.append((action, None))
        for transfer in self.p2p.post(items):
            if transfer.action.kind.is_send:
                state.sends.append(transfer)
            else:
                state.recvs[(transfer.action.kind, transfer.action.stage, transfer.action.microbatch)] = transfer
        state.sends = [t for t in state.sends if not _completed(t)]

    def _wait_for_inputs(self, action: Action, state: "_BatchState") -> None:
        """Wait for what a compute action needs from other ranks (the message it consumes; for
        STEP, the completion of this rank's sends), so the timeline shows the wait as idle."""
        if action.kind is ActionKind.STEP:
            for transfer in state.sends:
                self.p2p.wait(transfer)
            state.sends.clear()
            return
        kind = ActionKind.RECV_F if action.kind is ActionKind.F else ActionKind.RECV_B
        transfer = state.recvs.get((kind, action.stage, action.microbatch))
        if transfer is not None:
            self.p2p.wait(transfer)

    def _received(self, kind: ActionKind, stage: int, microbatch: int, state: "_BatchState") -> Optional[Transfer]:
        transfer = state.recvs.pop((kind, stage, microbatch), None)
        return None if transfer is None else self.p2p.received(transfer)

    # ---- compute --------------------------------------------------------------------------------
    def _compute(self, action: Action, microbatches: list[dict], state: "_BatchState") -> None:
        if action.kind is ActionKind.F:
            self._forward(action.stage, action.microbatch, microbatches[action.microbatch], state)
        elif action.kind is ActionKind.B:
            self._backward(action.stage, action.microbatch, state)
        elif action.kind is ActionKind.STEP:
            self.step()

    def _forward(self, stage: int, microbatch: int, batch: dict, state: "_BatchState") -> None:
        key = (stage, microbatch)
        chunk = self.chunks[self.schedule.chunk_of_stage(stage)]
        if stage == 0:
            inp = None
        else:
            received = self._received(ActionKind.RECV_F, stage, microbatch, state)
            source = received if received is not None else state.local_outputs.pop(key)
            inp = source.detach().requires_grad_(True)
        out = chunk(inp, batch)
        if stage == self.schedule.num_stages - 1:
            state.losses.append(out.detach())
            out = self.scale_loss(out / self.schedule.m)
        elif self.schedule.rank_of_stage(stage + 1) == self.ps.pp_rank:
            state.local_outputs[(stage + 1, microbatch)] = out.detach()
        else:
            state.outputs_to_send[key] = out
        state.saved[key] = (inp, out)
        state.peak_in_flight = max(state.peak_in_flight, len(state.saved))

    def _backward(self, stage: int, microbatch: int, state: "_BatchState") -> None:
        key = (stage, microbatch)
        inp, out = state.saved.pop(key)
        if stage == self.schedule.num_stages - 1:
            torch.autograd.backward(out)
        else:
            grad = self._received(ActionKind.RECV_B, stage, microbatch, state)
            if grad is None:
                grad = state.local_grads.pop(key)
            torch.autograd.backward(out, grad_tensors=grad)
        if stage == 0:
            return
        if self.schedule.rank_of_stage(stage - 1) == self.ps.pp_rank:
            state.local_grads[(stage - 1, microbatch)] = inp.grad
        else:
            state.input_grads[key] = inp.grad


def _completed(transfer: Transfer) -> bool:
    """True once every handle of a posted send has finished (checked without blocking)."""
    if not transfer.done and all(work.is_completed() for work in transfer.works):
        transfer.done = True
    return transfer.done


class _BatchState:
    """Tensors in flight during one batch, keyed by (stage, microbatch)."""

    def __init__(self):
        self.saved: dict = {}  # (input, output) kept for the backward
        self.outputs_to_send: dict = {}
        self.input_grads: dict = {}
        self.local_outputs: dict = {}  # handed to the next stage on this same rank
        self.local_grads: dict = {}
        self.recvs: dict = {}
        self.sends: list[Transfer] = []
        self.losses: list[float] = []
        self.peak_in_flight = 0
