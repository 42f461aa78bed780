"""Point-to-point transfers between pipeline stages, with the scatter/gather optimisation.

Consecutive SEND/RECV actions of a rank's list are posted together with
``batch_isend_irecv`` on the pipeline group's own communicator, so no collective of the
training loop queues behind a pending group. How posted groups progress is the transport
model of ``ir/transport.py``: on gloo a compute waits only on the handle of the receive it
consumes; on NCCL the whole group completes as one unit and the groups of a rank run in
issue order, and waiting only orders the device streams (NCCL's own watchdog enforces the
process group's timeout, so there is no host-side timed wait).

Strict transport (``MEGAPIPE_STRICT_TRANSPORT=1``, for CPU tests): gloo held to NCCL's rules.
A group is posted only once every earlier group of the rank has completed, and waiting for a
receive waits for its whole group, so a list that would hang under NCCL hangs here too and
fails with the timeout's sentence instead of passing on gloo's more forgiving progress.

Every message must live on the device the run computes on (``check_on_device``): NCCL carries
only device tensors, and a host tensor bound for it would fail there with NCCL's own words. The
check holds on every backend, so a host tensor fails by name also on gloo and on the fake device
of the CPU tests (where the run's device is not the host).

Scatter/gather (seed 002 4.4.1): a stage boundary tensor is replicated across the tensor
group, so instead of t identical copies each tensor rank sends only its 1/t slice to its
peer in the next stage, and the receivers all-gather the slices over the tensor group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.errors import PipelineTimeout
from megapipe.parallel.state import ParallelState
from megapipe.schedules.actions import Action
from megapipe.schedules.transport import Transport
from megapipe.tensor_parallel.mappings import _gather_first
from megapipe.parallel import progress


@dataclass
class Completion:
    """The handles that complete one or more transfers (all of a group's under grouped transports),
    and whether they have been waited on: a handle is waited on once (gloo's would block again)."""

    works: list
    done: bool = False


@dataclass
class Transfer:
    """One posted send or receive and what completes it."""

    action: Action
    buffer: torch.Tensor
    completion: Completion = field(default_factory=lambda: Completion([]))

    @property
    def works(self) -> list:
        return self.completion.works

    @property
    def done(self) -> bool:
        return self.completion.done

    @done.setter
    def done(self, value: bool) -> None:
        self.completion.done = value


def strict_transport_requested() -> bool:
    """True when ``MEGAPIPE_STRICT_TRANSPORT`` asks gloo to follow NCCL's rules (see the module docstring)."""
    return os.environ.get("MEGAPIPE_STRICT_TRANSPORT", "0") not in ("", "0")


def wait_for_peer(work, transport: Transport, timeout, ps: ParallelState, what: str, peer: str,
                  more_time: str) -> None:
    """Complete one message's ``work``: on NCCL by ordering the streams (the host does not block), on
    gloo within ``timeout``, else a PipelineTimeout naming this rank, the message and the silent peer."""
    if transport is Transport.NCCL:
        work.wait()
        return
    try:
        work.wait(timeout)
    except RuntimeError as error:
        where = f"rank {ps.rank} (pipeline stage {ps.pp_rank})"
        if connection_lost(error):
            raise PipelineTimeout(
                f"{where} lost its connection to {peer} during {what}: that rank stopped first; its log names "
                f"the cause. ({error})") from error
        raise PipelineTimeout(
            f"{where} waited more than {timeout.total_seconds():.0f} s on {what} with {peer}, which never "
            f"answered; check that rank's log for an error or raise {more_time}. ({error})") from error


def connection_lost(error: Exception) -> bool:
    """True when gloo reports the peer's socket closed (the peer exited or crashed), not a timeout."""
    text = str(error)
    return any(sign in text for sign in ("Connection reset by peer", "Connection closed by peer", "Broken pipe"))


def check_on_device(tensor: torch.Tensor, device: torch.device, what: str) -> None:
    """Refuse, in one sentence, a pipeline message that is not on the run's device (``cuda`` names
    the current CUDA device, so it matches any index)."""
    device = torch.device(device)
    if tensor.device.type != device.type or device.index not in (None, tensor.device.index):
        raise RuntimeError(f"the {what} sent or received between pipeline stages is on {tensor.device} but this run "
                           f"computes on {device}; pipeline messages must be on the run's device (create the tensor "
                           "there, device=...), as NCCL carries no host tensors.")


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
        # with one stage there are no messages (and maybe no process group at all)
        self.transport = Transport.of_backend(dist.get_backend(ps.pp_group)) if ps.pp_size > 1 else Transport.GLOO
        self.strict = self.transport is Transport.GLOO and strict_transport_requested()
        self.grouped = self.strict or self.transport is Transport.NCCL  # one completion per group
        self._pending: list[list[Transfer]] = []  # strict: posted groups, in issue order

    def post(self, items: list[tuple[Action, Optional[torch.Tensor]]]) -> list[Transfer]:
        """Post sends (with their tensors) and receives (tensor ``None``) as one batch."""
        if self.strict:  # NCCL starts a group only when the rank's previous group has completed
            for group in self._pending:
                for transfer in group:
                    self.wait(transfer)
            self._pending = []
        ops, transfers = [], []
        for action, tensor in items:
            peer = self.ps.stage_rank(action.peer)
            if action.kind.is_send:
                buffer = self._outgoing(tensor)
                ops.append(dist.P2POp(dist.isend, buffer, peer, self.ps.pp_group))
                self.bytes_sent += buffer.numel() * buffer.element_size()
                self.messages_sent += 1
            else:
                buffer = torch.empty(self.message_numel, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, peer, self.ps.pp_group))
            check_on_device(buffer, self.device, f"{action} tensor")
            transfers.append(Transfer(action, buffer))
        works = dist.batch_isend_irecv(ops)
        shared = Completion(list(works))
        for i, transfer in enumerate(transfers):
            one_each = len(works) == len(transfers) and not self.grouped
            transfer.completion = Completion([works[i]]) if one_each else shared
        if self.strict:
            self._pending.append(transfers)
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
        action = transfer.action
        peer = f"global rank {self.ps.stage_rank(action.peer)} (pipeline stage {action.peer})"
        with progress.collective(f"{action} with {peer}", self.ps.pp_group, counted=False):
            for work in transfer.works:
                wait_for_peer(work, self.transport, self.timeout, self.ps, f"{action}", peer,
                              "--distributed-timeout-minutes")
        transfer.done = True

    def received(self, transfer: Transfer) -> torch.Tensor:
        """Wait for a receive and return the full boundary tensor (all-gathered if scattered)."""
        self.wait(transfer)
        flat = transfer.buffer
        if self.scatter_gather:
            flat = _gather_first(flat, self.ps.tp_group)
        return flat.view(self.shape)
