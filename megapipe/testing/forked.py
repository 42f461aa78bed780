"""A Python script run as ``__main__`` in a process of its own, forked from the server of ``worlds.py`` that has
already imported torch, instead of in a new interpreter.

A new interpreter spends about three seconds of CPU importing torch (and ``torch._dynamo``) before the
script's first line; tests that start a script many times (to kill it at random moments and start it
again) pay that each time. The forked process is the script's own in every other way: its ``argv``,
environment and working directory, its output on a pipe the caller reads, its own session (so its
process group can be killed), and its exit status (``SystemExit`` as Python's; -9 once SIGKILLed). One
difference: like every ``multiprocessing`` process it ends without running ``atexit`` handlers, so a
script that relies on them is started as a new interpreter instead.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from typing import Optional

from megapipe.testing.worlds import preloaded_context


def _run_script(argv: list[str], environ: dict, cwd: str, output) -> None:
    """In the forked process: become the script's own session with its output on the pipe, then run it."""
    os.setsid()
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    output.close()
    os.environ.clear()  # the caller's environment, not the server's from when it started
    os.environ.update(environ)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


class ForkedProcess:
    """``subprocess.Popen``'s view of a forked script (``pid``, ``stdout`` as text lines, ``poll``, ``wait``,
    ``returncode``), output and errors merged as with ``stderr=STDOUT``."""

    def __init__(self, argv: list[str], env: dict, cwd: str):
        self.args = argv
        context = preloaded_context()
        reader, writer = context.Pipe(duplex=False)
        self._process = context.Process(target=_run_script, args=(argv, env, cwd, writer), daemon=True)
        self._process.start()
        writer.close()  # the child holds the only write end: the pipe ends when it does
        self.pid = self._process.pid
        self.stdout = os.fdopen(os.dup(reader.fileno()), "r")
        reader.close()

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode
