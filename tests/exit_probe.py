"""Run a script as ``__main__`` and report, just before the interpreter's teardown, which threads still live.

``python exit_probe.py SCRIPT [ARGS...]`` runs SCRIPT as ``python SCRIPT [ARGS...]`` would (its argv, its
folder first on ``sys.path``, its exit status). Its handler is the first one registered with ``atexit``,
so it runs last, after every handler the script registers and right before the interpreter tears itself
down, and prints one line to stderr: ``exit probe: N threads besides the main one: {name: count}``
(names from ``/proc/self/task/*/comm``: gloo's are ``pt_gloo_runloop`` and ``gloo_tcp_loop``; a Python
thread's is its interpreter's), once no thread is leaving any more (``SETTLE_SECONDS``).
A thread still running there may touch the interpreter while it is being dismantled, which is what
aborted finished ranks ("terminate called without an active exception"); a run whose line says 0
cannot abort that way, whatever the timing.
"""

import atexit
import os
import runpy
import sys
import time

PREFIX = "exit probe: "
# A Python thread that was joined has given up the interpreter but may still be leaving the kernel's
# task list; one still running after this long is not leaving (a live group's gloo threads never do).
SETTLE_SECONDS = 2.0


def _threads() -> dict[str, int]:
    """Name -> count of this process's threads besides the main one."""
    names: dict[str, int] = {}
    for task in os.listdir("/proc/self/task"):
        if int(task) == os.getpid():  # the main thread
            continue
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # it ended while we looked
            continue
        names[name] = names.get(name, 0) + 1
    return names


def _report() -> None:
    deadline = time.monotonic() + SETTLE_SECONDS
    while (names := _threads()) and time.monotonic() < deadline:  # nothing signals a thread's last exit step,
        time.sleep(0.01)  # so its task entry is polled for, up to the deadline
    line = f"{PREFIX}{sum(names.values())} threads besides the main one: {names}\n"
    os.write(2, line.encode())  # one write: the ranks share torchrun's stderr, and lines must not interleave


if __name__ == "__main__":
    atexit.register(_report)
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")
