"""When training stops early and how long peers wait.

* ``ExitConditions``: Megatron's exits. ``--exit-interval`` is known on every rank; SIGTERM,
  ``--exit-duration-in-mins`` and the cluster lease are agreed on so that all ranks stop together,
  off the hot path: an all-reduce on a CPU group started at one iteration boundary and read at
  the next (``LaggedAgreement``), and none at all when there is nothing to agree on.
* Preemption (``--exit-signal-grace-seconds``): SIGKILL follows the first SIGTERM by the grace
  period. A SIGTERM during start-up stops the run before its first iteration; later, the exit
  save is made only if every rank has the last save's duration left (``time_for``); otherwise
  the run exits without it and the previous checkpoint stays (a save is published atomically
  anyway, so one cut off by SIGKILL leaves the previous one too).

(How a failure is reported: ``failures.py``.)
"""

from __future__ import annotations

import datetime
import time
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.config import Config
from megapipe.training.sigterm import SigtermNotice

EXIT_SECONDS = 2.0
"""Seconds an exit takes after its save (draining a pipeline, closing the groups, ending the
processes), kept free of the grace period when deciding whether the save fits (``time_for``)."""


class ExitConditions:
    """Why training should stop before ``--train-iters``, or None: the same answer on every rank.

    ``--exit-interval`` is known on every rank and needs no agreement. SIGTERM may reach one rank
    only, the clock differs between hosts and only rank 0 holds the cluster lease
    (``--cluster-lease``), so in a world of more than one rank these are agreed on, lagged
    (``LaggedAgreement``): a rank's flags are started at one iteration boundary and read at the
    next, so no rank waits for another and no device value is read; such an exit comes one
    iteration after the flag was raised (``lag``). With nothing to agree on (``exit_on_sigterm``
    off, so no SIGTERM handler, no ``--exit-duration-in-mins`` and no ``--cluster-lease``) or in a
    world of one rank, a boundary runs no collective at all.
    """

    def __init__(self, config: Config, start_time: Optional[float] = None, lease=None,
                 notice: Optional[SigtermNotice] = None):
        t = config.training
        self.config = config
        self.exit_interval, self.exit_minutes = t.exit_interval, t.exit_duration_in_mins
        self.grace = t.exit_signal_grace_seconds
        self.start = time.time() if start_time is None else start_time
        self.sigterm = False
        self.lease = lease  # a ClusterLease on the rank that talks to the scheduler, else None
        # exits one rank may see alone: a SIGTERM it handles, its clock, the lease (the same on every rank)
        self.watched = t.exit_on_sigterm or t.exit_duration_in_mins is not None or t.cluster_lease is not None
        self._agreement: Optional[LaggedAgreement] = None  # made at the first boundary that needs it
        # the entry point's notice (installed before torch was imported), else one installed now
        self.notice = notice or SigtermNotice()
        if not t.exit_on_sigterm and notice is not None:
            notice.uninstall()
        elif t.exit_on_sigterm and notice is None:
            self.notice.install()

    def _noticed(self) -> bool:
        """Whether this rank got SIGTERM (noticed by the handler, or set by hand in tests)."""
        self.sigterm = self.sigterm or self.notice.count > 0
        return self.sigterm

    def seconds_left(self) -> Optional[float]:
        """Seconds until this rank's SIGKILL (``--exit-signal-grace-seconds`` after its first SIGTERM);
        None when none is coming."""
        if self.grace is None or self.notice.first is None:
            return None
        return self.grace - (time.monotonic() - self.notice.first)

    def time_for(self, seconds: float) -> bool:
        """Whether every rank has ``seconds``, and ``EXIT_SECONDS`` more to exit, before its SIGKILL; the same
        answer on every rank (collective where the ranks agree on exits; no collective without a grace period)."""
        if self.grace is None:
            return True
        left = self.seconds_left()
        spare = float("inf") if left is None else left - seconds - EXIT_SECONDS
        if self.lag:
            spare = self._agreed().least(spare)
        return spare > 0

    def reason_at_start(self, iteration: int) -> Optional[str]:
        """A SIGTERM that reached any rank during start-up (or the load), agreed on at once: the run then
        stops before its first iteration, its checkpoint being the one it loaded. Every rank calls it
        once, before the first ``reason``."""
        sigterm = self._noticed()
        if self.lag:
            sigterm = self._agreed().least(-float(sigterm)) < 0
        return f"SIGTERM at iteration {iteration}, during start-up" if sigterm else None

    def _agreed(self) -> "LaggedAgreement":
        if self._agreement is None:
            self._agreement = LaggedAgreement(self.config.training.collective_timeout)
        return self._agreement

    @property
    def lag(self) -> int:
        """Iterations between a rank's flag and the exit it causes: 1 when the ranks agree on it, else 0."""
        return int(self.watched and dist.is_initialized() and dist.get_world_size() > 1)

    def reason(self, iteration: int) -> Optional[str]:
        """The reason to stop after ``iteration``, the same on every rank; every rank calls it at every boundary."""
        minutes = (time.time() - self.start) / 60
        flags = [self._noticed(), self.lease is not None and self.lease.stop_reason(iteration) is not None,
                 self.exit_minutes is not None and minutes > self.exit_minutes]
        if self.lag:
            flags = self._agreed().exchange(flags)
        sigterm, lease_ended, out_of_time = flags
        if sigterm:
            return f"SIGTERM at iteration {iteration}"
        if lease_ended:
            return f"the end of the cluster lease at iteration {iteration}"
        if out_of_time:
            return f"--exit-duration-in-mins {self.exit_minutes:g} at iteration {iteration}"
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} at iteration {iteration}"
        return None

    def close(self) -> None:
        """Complete the agreement still in flight (every rank started it, so this does not wait long)
        and let its group go now, not when this object goes."""
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None


class LaggedAgreement:
    """Whether any rank raised each of a few flags, learnt one boundary late without waiting.

    ``exchange(flags)`` starts an all-reduce (MAX) of this rank's flags on a gloo group of its own
    (no pipeline message or device collective queues behind it) and returns what all ranks raised
    at the previous call (nothing at the first). That earlier all-reduce has completed unless some
    rank is a whole iteration behind. The flags live in host memory and are read through numpy
    (which refuses a device tensor): no device synchronisation. Every rank must call ``exchange``
    at the same boundaries; the first call builds the group, a collective over the world. The group
    has the job's timeout: an all-reduce left in flight when a peer is lost fails within it, so the
    rank's exit (which waits for its groups' work) is not held for gloo's default half hour.
    """

    def __init__(self, timeout: datetime.timedelta):
        self._group = dist.new_group(backend="gloo", timeout=timeout)
        self._pending = None  # (flags, work) of the all-reduce started at the last call

    def exchange(self, flags: list[bool]) -> list[bool]:
        mine = torch.tensor(flags, dtype=torch.float32)
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        previous, self._pending = self._pending, (mine, work)
        if previous is None:
            return [False] * len(flags)
        previous[1].wait()
        return [bool(value) for value in previous[0].numpy()]

    def least(self, value: float) -> float:
        """The smallest ``value`` over the ranks, now (waits for every rank; after what is in flight)."""
        mine = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self._group)
        return float(mine.numpy()[0])

    def close(self) -> None:
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None
