"""Running a job: when training stops early, how long peers wait, and how user errors are reported.

* ``validate_operations``: the operations flags (``--exit-interval``, ``--exit-duration-in-mins``,
  ``--distributed-timeout-minutes``, ``--skip-train``, ``--load``, ``--mock-data``, the two
  scheduler-on-resume flags), checked before any process group, one sentence per mistake.
* ``ExitConditions``: Megatron's exits. ``--exit-interval`` is known on every rank; SIGTERM,
  ``--exit-duration-in-mins`` and the cluster lease are agreed on so that all ranks stop together,
  off the hot path: an all-reduce on a CPU group started at one iteration boundary and read at
  the next (``LaggedAgreement``), and none at all when there is nothing to agree on.
* ``report_user_error``: under torchrun every rank usually finds the same mistake; only the first
  rank to find it prints it, the others exit with the same code in silence.
* ``explain_lost_peers``: a collective or pipeline message that failed because a peer went away
  becomes one sentence naming the ranks lost (a roll call in the rendezvous store), or the
  rendezvous host when the store itself cannot be reached.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.config import Config
from megapipe.errors import ConfigError, PeerLost, PipelineTimeout

USER_ERROR_KEY = "megapipe/user-error-reported"
REPORT_STORE_TIMEOUT = datetime.timedelta(seconds=10)  # the store may sit on a host that is gone
ROLL_CALL_KEY = "megapipe/roll-call/"


def distributed_timeout(config: Config) -> datetime.timedelta:
    """``--distributed-timeout-minutes`` as the timeout of every collective."""
    return datetime.timedelta(minutes=config.training.distributed_timeout_minutes)


def validate_operations(kind: str, config: Config) -> None:
    """Raise ConfigError naming the flag for a bad operations flag or combination."""
    t, data = config.training, config.data
    if t.distributed_timeout_minutes <= 0:
        raise ConfigError(f"--distributed-timeout-minutes {t.distributed_timeout_minutes:g} must be above 0: it is "
                          "how long a collective waits for a peer before failing.")
    if t.exit_interval is not None and t.exit_interval < 1:
        raise ConfigError(f"--exit-interval {t.exit_interval} must be at least 1 (iterations between the save "
                          "and the exit); drop the flag to train to --train-iters.")
    if t.exit_duration_in_mins is not None and t.exit_duration_in_mins <= 0:
        raise ConfigError(f"--exit-duration-in-mins {t.exit_duration_in_mins:g} must be above 0; drop the flag to "
                          "train to --train-iters.")
    if t.skip_train and not t.load:
        raise ConfigError("--skip-train evaluates a checkpoint and needs --load DIR; pass the checkpoint directory.")
    if t.load and not os.path.isdir(t.load) and (t.skip_train or not _same_path(t.load, t.save)):
        raise ConfigError(f"--load {t.load} does not exist; pass a checkpoint directory (or the --save directory, "
                          "to start a job that resumes itself).")
    if t.cluster_lease is not None and not t.cluster_lease.startswith("http://"):
        raise ConfigError(f"--cluster-lease {t.cluster_lease} is not an http:// address; the scheduler service sets "
                          "it, so drop the flag when running outside the cluster.")
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler exclude each "
                          "other; keep the one whose learning-rate schedule the resumed run should follow.")
    if data.mock_data:
        if kind != "gpt":
            raise ConfigError(f"--mock-data makes GPT samples only; pretrain_{kind}.py needs --data-path or the "
                              "embedded corpus.")
        if data.data_path:
            raise ConfigError("--mock-data replaces --data-path; drop one of them.")
        if data.vocab_size is None or data.vocab_size < 2:
            raise ConfigError(f"--mock-data needs --vocab-size N (at least 2, got {data.vocab_size}): the "
                              "synthetic tokens are drawn from [0, N).")
    elif data.vocab_size is not None:
        raise ConfigError("--vocab-size sets the vocabulary of --mock-data only (real data takes it from the "
                          "tokenizer); add --mock-data or drop --vocab-size.")


def _same_path(a: str, b: Optional[str]) -> bool:
    return b is not None and os.path.abspath(a) == os.path.abspath(b)


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

    def __init__(self, config: Config, start_time: Optional[float] = None, lease=None):
        t = config.training
        self.config = config
        self.exit_interval, self.exit_minutes = t.exit_interval, t.exit_duration_in_mins
        self.start = time.time() if start_time is None else start_time
        self.sigterm = False
        self.lease = lease  # a ClusterLease on the rank that talks to the scheduler, else None
        # exits one rank may see alone: a SIGTERM it handles, its clock, the lease (the same on every rank)
        self.watched = t.exit_on_sigterm or t.exit_duration_in_mins is not None or t.cluster_lease is not None
        self._agreement: Optional[LaggedAgreement] = None  # made at the first boundary that needs it
        if t.exit_on_sigterm:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.sigterm = True

    @property
    def lag(self) -> int:
        """Iterations between a rank's flag and the exit it causes: 1 when the ranks agree on it, else 0."""
        return int(self.watched and dist.is_initialized() and dist.get_world_size() > 1)

    def reason(self, iteration: int) -> Optional[str]:
        """The reason to stop after ``iteration``, the same on every rank; every rank calls it at every boundary."""
        minutes = (time.time() - self.start) / 60
        flags = [self.sigterm, self.lease is not None and self.lease.stop_reason(iteration) is not None,
                 self.exit_minutes is not None and minutes > self.exit_minutes]
        if self.lag:
            if self._agreement is None:
                self._agreement = LaggedAgreement(distributed_timeout(self.config))
            flags = self._agreement.exchange(flags)
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
        """Complete the agreement still in flight (every rank started it, so this does not wait long)."""
        if self._agreement is not None:
            self._agreement.close()


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

    def close(self) -> None:
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None


def report_user_error(error: Exception) -> None:
    """Print ``error: ...`` on the first rank that reports it (one line per job, not per rank).

    With a process group the ranks race on a counter in its store; without one (a flag checked
    before any group exists, which every rank finds alike) rank 0 prints. A rank that cannot
    reach the store (``PeerLost``) prints its own view.
    """
    if not getattr(error, "store_reachable", True) or _first_to_report():
        print(f"error: {error}", file=sys.stderr, flush=True)


def _first_to_report() -> bool:
    if not dist.is_initialized():
        return os.environ.get("RANK", "0") == "0"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(REPORT_STORE_TIMEOUT)
        return store.add(USER_ERROR_KEY, 1) == 1
    except RuntimeError:  # the store went away with its host, or cannot be reached: better twice than never
        return True


def is_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a communication failure: a pipeline message or a collective whose peer is gone."""
    if isinstance(error, PipelineTimeout):
        return True
    return dist.is_initialized() and (isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(mark in str(error) for mark in ("/gloo/", "Connection reset",
                                                                                 "Connection closed"))))


def explain_lost_peers(error: BaseException) -> PeerLost:
    """One sentence for a communication failure: which ranks did not answer a roll call in the store
    (every rank that is still running reaches this point within the timeout and answers), or that
    the store's host cannot be reached."""
    import socket

    rank, world = dist.get_rank(), dist.get_world_size()
    cause = str(error).splitlines()[0] if str(error) else type(error).__name__
    address = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0")))
    try:
        # a store client can block past its timeout on a silent link: ask the network first
        socket.create_connection(address, timeout=REPORT_STORE_TIMEOUT.total_seconds()).close()
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(REPORT_STORE_TIMEOUT)
        store.set(f"{ROLL_CALL_KEY}{rank}", "here")
        try:
            store.wait([f"{ROLL_CALL_KEY}{r}" for r in range(world)], REPORT_STORE_TIMEOUT)
        except RuntimeError:
            pass  # someone is missing: find out who
        missing = [r for r in range(world) if not store.check([f"{ROLL_CALL_KEY}{r}"])]
    except (OSError, RuntimeError):
        return PeerLost(f"rank {rank} lost the job: its rendezvous store at {address[0]}:{address[1]} (the host of "
                        f"rank 0) cannot be reached either, so that host is gone or this host's link is cut ({cause}); "
                        "restart the job with --load once every host is back.", store_reachable=False)
    lost = ", ".join(map(str, missing)) if missing else "none (all answered the roll call; a peer failed on its own)"
    return PeerLost(f"rank {rank} lost contact with rank(s) {lost} of {world}: they did not answer within "
                    f"{REPORT_STORE_TIMEOUT.total_seconds():.0f} s, so their process or host is gone or its link is "
                    f"cut ({cause}); restart the job with --load once every host is back.")
