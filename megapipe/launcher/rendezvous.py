"""Before a node waits on torchrun: does torchrun's rendezvous store answer at MASTER_ADDR:PORT?

A bare TCP connect proves only that something accepts connections; a proxy or another service
on the port does too, and torchrun then fails on it with hundreds of lines of C++ stack frames.
So the check speaks the store's own protocol: a ``TCPStore`` client (the one torchrun's c10d
rendezvous uses) connects, retrying until the deadline while node 0 may still be starting, and
reads a key. It runs in a child process whose stderr is discarded (the store client logs every
retry with its stack) and which is killed at the deadline (a peer that accepts and never
answers would hold a client past its own timeout). When the store does not answer, one bare
connect tells an address where nothing answers from one where something else does.

    python -m megapipe.launcher.rendezvous HOST PORT SECONDS   # exit 0, or 2 with one sentence
"""

from __future__ import annotations

import socket
import subprocess
import sys

from megapipe.errors import ConfigError, reports_user_errors

GRACE_SECONDS = 10  # past the store client's own timeout, for its last retry and the child's start
PROBE = ("import datetime, sys, torch.distributed as dist; host, port, seconds = sys.argv[1:]; "
         "dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=float(seconds)), "
         "wait_for_workers=False).check(['megapipe/rendezvous-probe'])")


def store_answers(host: str, port: int, seconds: float) -> bool:
    """Whether a rendezvous store at ``host:port`` answers a read within about ``seconds``."""
    try:
        probe = subprocess.run([sys.executable, "-c", PROBE, host, str(port), str(seconds)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=seconds + GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


def accepts_connections(host: str, port: int, seconds: float = 5) -> bool:
    try:
        socket.create_connection((host, port), timeout=seconds).close()
    except OSError:
        return False
    return True


def check_rendezvous(host: str, port: int, seconds: float) -> None:
    """Raise ConfigError, one sentence naming the address and the fix, unless the store answers."""
    if store_answers(host, port, seconds):
        return
    if accepts_connections(host, port):
        raise ConfigError(f"MASTER_ADDR={host} port {port} accepts connections but is not torchrun's rendezvous store "
                          "(a proxy or another service answers there); set MASTER_ADDR to node 0's own address, or "
                          "MASTER_PORT to a port free on node 0.")
    raise ConfigError(f"the rendezvous endpoint MASTER_ADDR={host} port {port} did not answer within "
                      f"RDZV_TIMEOUT={seconds:g} s; check that MASTER_ADDR is node 0's address and that node 0 has "
                      "started.")


@reports_user_errors
def main(argv: list[str]) -> int:
    host, port, seconds = argv
    check_rendezvous(host, int(port), float(seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
