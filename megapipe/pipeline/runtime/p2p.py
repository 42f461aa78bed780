"""Point-to-point transfers between pipeline stages, with the scatter/gather optimisation.

Consecutive SEND/RECV actions of a rank's list are posted together with
``batch_isend_irecv``; a compute action later waits only on the handles of the receive it
consumes (gloo returns one handle per operation; a backend that returns one handle for the
whole batch makes every operation of the batch share it).

Scatter/gather (seed 002 4.4.1): a stage boundary tensor is replicated across the tensor
group, so instead of t identical copies each tensor rank sends only its 1/t slice to its
peer in the next stage, and the receivers all-gather the slices over the tensor group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.errors import PipelineTimeout
from megapipe.parallel_state import ParallelState
from megapipe.pipeline.ir.actions import Action
from megapipe.tensor_parallel.mappings import _gather_first


@dataclass
class Transfer:
    """One posted send or receive and the handles that complete it."""

    action: Action
    buffer: torch.Tensor
    works: list = field(default_factory=list)
    done: bool = False


class StageP2P:
    """Posts and completes the stage-boundary messages of one rank."""

    def __init__(self, ps: ParallelState, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 scatter_gather: bool, timeout: datetime.timedelta):
        self.ps, self.shape, self.dtype, self.device, self.timeout = ps, tuple(shape), dtype, device, timeout
        numel = 1
        for n in shape:
            numel *= n
        self.scatter_gather = scatter_gather and ps.tp_size > 1 and numel % ps.tp_size == 0
        self.message_numel = numel // ps.tp_size if self.scatter_gather else numel
        self.bytes_sent = 0
        self.messages_sent = 0

    def post(self, items: list[tuple[Action, Optional[torch.Tensor]]]) -> list[Transfer]:
        """Post sends (with their tensors) and receives (tensor ``None``) as one batch."""
        ops, transfers = [], []
        for action, tensor in items:
            peer = self.ps.stage_rank(action.peer)
            if action.kind.is_send:
                buffer = self._outgoing(tensor)
                ops.append(dist.P2POp(dist.isend, buffer, peer))
                self.bytes_sent += buffer.numel() * buffer.element_size()
                self.messages_sent += 1
            else:
                buffer = torch.empty(self.message_numel, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, peer))
            transfers.append(Transfer(action, buffer))
        works = dist.batch_isend_irecv(ops)
        for i, transfer in enumerate(transfers):
            transfer.works = [works[i]] if len(works) == len(transfers) else list(works)
        return transfers

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != self.shape:
            raise RuntimeError(f"stage boundary tensor has shape {tuple(tensor.shape)}, expected {self.shape}; "
                               "every microbatch must have the configured --seq-length and --micro-batch-size")
        flat = tensor.detach().reshape(-1)
        if self.scatter_gather:
            flat = flat.chunk(self.ps.tp_size)[self.ps.tp_rank]
        return flat.to(self.dtype).contiguous()

    def wait(self, transfer: Transfer) -> None:
        """Complete a transfer, or fail with a sentence naming who never answered."""
        if transfer.done:
            return
        for work in transfer.works:
            try:
                work.wait(self.timeout)
            except RuntimeError as error:
                action = transfer.action
                peer = self.ps.stage_rank(action.peer)
                raise PipelineTimeout(
                    f"rank {self.ps.rank} (pipeline stage {self.ps.pp_rank}) waited more than "
                    f"{self.timeout.total_seconds():.0f} s on {action} with global rank {peer} (pipeline stage "
                    f"{action.peer}), which never answered; check that rank's log for an error or raise "
                    f"MEGAPIPE_TIMEOUT. ({error})") from error
        transfer.done = True

    def received(self, transfer: Transfer) -> torch.Tensor:
        """Wait for a receive and return the full boundary tensor (all-gathered if scattered)."""
        self.wait(transfer)
        flat = transfer.buffer
        if self.scatter_gather:
            flat = _gather_first(flat, self.ps.tp_group)
        return flat.view(self.shape)
