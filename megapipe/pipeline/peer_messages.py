"""Pipeline messages outside a training schedule (generation, scoring): one tensor at a time, of
any shape and dtype, between this rank and a peer (global ranks, default group).

Sends are asynchronous; a receive returns once its tensor may be used. Every message lives on the
run's device (``check_on_device``: NCCL carries no host tensors). NCCL runs the messages of a pair
of ranks on one communicator in issue order, so a receive from a peer completes only after every
earlier send to that peer has been received: two ranks that each send before receiving what the
other sent first wait on each other forever. The strict transport (``MEGAPIPE_STRICT_TRANSPORT``)
holds gloo to that rule, a receive first waiting for this rank's earlier sends to the same peer, so
such an order hangs on a CPU too and fails with the timeout's sentence. Waits on gloo are timed;
on NCCL they only order the device streams (the process group's watchdog enforces its timeout).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.parallel.launch import default_timeout
from megapipe.parallel.state import ParallelState
from megapipe.schedules.transport import Transport
from megapipe.pipeline.p2p import check_on_device, strict_transport_requested, wait_for_peer


@dataclass
class _Send:
    work: object
    tensor: torch.Tensor  # kept alive until the send has completed
    what: str


class PeerMessages:
    """This rank's messages to and from its pipeline peers."""

    def __init__(self, ps: ParallelState, device: torch.device, timeout: datetime.timedelta | None = None):
        self.ps, self.device, self.timeout = ps, device, timeout or default_timeout()
        self.transport = Transport.of_backend(dist.get_backend()) if ps.pp_size > 1 else Transport.GLOO
        self.strict = self.transport is Transport.GLOO and strict_transport_requested()
        self.sends: dict[int, list[_Send]] = {}  # per peer, the sends not known to have completed

    def send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        check_on_device(tensor, self.device, what)
        pending = [s for s in self.sends.get(peer, []) if not s.work.is_completed()]
        pending.append(_Send(dist.isend(tensor.contiguous(), peer), tensor, what))
        self.sends[peer] = pending

    def recv(self, shape: tuple, dtype: torch.dtype, peer: int, what: str) -> torch.Tensor:
        if self.strict:  # NCCL's order: this pair's earlier sends complete first
            for sent in self.sends.pop(peer, []):
                self._wait(sent.work, f"send of the {sent.what}", peer)
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        check_on_device(tensor, self.device, what)
        self._wait(dist.irecv(tensor, peer), f"receive of the {what}", peer)
        return tensor

    def send_int(self, value: int, peer: int, what: str) -> None:
        """A control word: made on the device from a host value (a kernel argument, no copy)."""
        self.send(torch.full((1,), value, dtype=torch.long, device=self.device), peer, what)

    def recv_int(self, peer: int, what: str) -> int:
        """A control word, read on the host: a synchronisation with the device."""
        return int(self.recv((1,), torch.long, peer, what).item())

    def finish(self) -> None:
        """Complete every send (before the tensors they carry may change)."""
        for peer, pending in self.sends.items():
            for sent in pending:
                self._wait(sent.work, f"send of the {sent.what}", peer)
        self.sends.clear()

    def _wait(self, work, what: str, peer: int) -> None:
        wait_for_peer(work, self.transport, self.timeout, self.ps, f"the {what}", f"global rank {peer}",
                      "MEGAPIPE_TIMEOUT")
