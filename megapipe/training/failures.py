"""How a job reports what went wrong: a user's mistake once per job, a lost peer as one sentence.

* ``report_user_error``: under torchrun every rank usually finds the same mistake; each hands it
  to torchrun (``megapipe.launcher``), which prints it once when megapipe's hook runs in it;
  otherwise only the first rank to find it prints it, the others exit with the same code in silence.
* ``explain_lost_peers``: a collective or pipeline message that failed because a peer went away
  becomes one sentence naming the ranks lost (a roll call in the rendezvous store), or the
  rendezvous host when the store itself cannot be reached.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from megapipe.errors import PeerLost, PipelineTimeout, print_error
from megapipe.launcher.usage_errors import hand_to_launcher

USER_ERROR_KEY = "megapipe/user-error-reported"
REPORT_STORE_TIMEOUT = datetime.timedelta(seconds=10)  # the store may sit on a host that is gone
ROLL_CALL_KEY = "megapipe/roll-call/"


def report_user_error(error: Exception) -> None:
    """Print ``error: ...`` on the first rank that reports it (one line per job, not per rank),
    unless torchrun prints it (``hand_to_launcher``; never a lost peer's, which each rank that
    cannot reach the store prints at once in its own view).

    With a process group the ranks race on a counter in its store; without one (a flag checked
    before any group exists, which every rank finds alike) rank 0 prints. A rank that cannot
    reach the store (``PeerLost``) prints its own view.
    """
    if not isinstance(error, PeerLost) and hand_to_launcher(str(error)):
        return  # a lost peer is said at once, where it was seen: that host's torchrun may be cut off too
    if not getattr(error, "store_reachable", True) or _first_to_report():
        print_error(error)


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
