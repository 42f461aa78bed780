"""A Python script (or ``-m module``) run as ``__main__`` in a process of its own, forked from the server of
``worlds.py`` that has already imported torch, instead of in a new interpreter.

A new interpreter spends about three seconds of CPU importing torch (and ``torch._dynamo``) before the
script's first line; tests that start a script many times (to kill it at random moments and start it
again) pay that each time. The forked process is the script's own in every other way: its ``argv``,
environment and working directory, its output on a pipe the caller reads, its own session (so its
process group can be killed), and its exit status (``SystemExit`` as Python's; -9 once SIGKILLed). One
difference: like every ``multiprocessing`` process it ends without running ``atexit`` handlers, so a
script that relies on them is started as a new interpreter instead.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
from typing import Optional

from megapipe.testing.worlds import preloaded_context


def _run_script(argv: list[str], environ: dict, cwd: str, output, errors) -> None:
    """In the forked process: become the script's own session with its output and errors on the pipes
    (``errors`` None: on the output's), then run it."""
    os.setsid()
    os.dup2(output.fileno(), 1)
    os.dup2((errors or output).fileno(), 2)
    for pipe in (output, errors):
        if pipe is not None:
            pipe.close()
    os.environ.clear()  # the caller's environment, not the server's from when it started
    os.environ.update(environ)
    os.chdir(cwd)
    multiprocessing.current_process().daemon = False  # the script may start processes of its own, as when run directly
    import torch

    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    if argv[0] == "-m":  # as Python's -m: the working directory first on sys.path, argv[0] the module's path
        sys.path.insert(0, os.getcwd())
        sys.argv = list(argv[1:])
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:  # as Python's script: its directory first on sys.path
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


class ForkedProcess:
    """``subprocess.Popen``'s view of a forked script (``pid``, ``stdout`` and ``stderr`` as text, ``poll``,
    ``wait``, ``returncode``); with ``merge_errors`` its errors come on ``stdout``, as with ``stderr=STDOUT``."""

    def __init__(self, argv: list[str], env: dict, cwd: str, merge_errors: bool = True):
        self.args = argv
        context = preloaded_context()
        pipes = [context.Pipe(duplex=False) for _ in range(1 if merge_errors else 2)]
        writers = [writer for _, writer in pipes] + [None] * merge_errors
        self._process = context.Process(target=_run_script, args=(argv, env, cwd, *writers), daemon=True)
        self._process.start()
        self.pid = self._process.pid
        readers = []
        for reader, writer in pipes:
            writer.close()  # the child holds the only write end: the pipe ends when it does
            readers.append(os.fdopen(os.dup(reader.fileno()), "r"))
            reader.close()
        self.stdout, self.stderr = readers if len(readers) == 2 else (readers[0], None)

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def kill(self) -> None:
        """SIGKILL to the script's process group (to the process alone before it has made its session), waited for."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                os.kill(self.pid, signal.SIGKILL)
        self._process.join(10)

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode


def run_script(argv: list[str], env: dict, cwd: str, timeout: float,
               merge_errors: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([python, *argv], capture_output=True, text=True, timeout=timeout)`` with the script forked
    (with ``merge_errors``, ``stderr=STDOUT`` instead); past ``timeout`` its process group is killed and
    ``subprocess.TimeoutExpired`` raised."""
    process = ForkedProcess(argv, env, cwd, merge_errors)
    texts: dict[str, str] = {}
    pipes = (("stdout", process.stdout),) + ((("stderr", process.stderr),) if process.stderr else ())
    readers = [threading.Thread(target=lambda name=name, pipe=pipe: texts.update({name: pipe.read()}), daemon=True)
               for name, pipe in pipes]
    for reader in readers:
        reader.start()
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    finally:
        for reader in readers:
            reader.join(10)
        for _, pipe in pipes:
            pipe.close()
    return subprocess.CompletedProcess([sys.executable, *argv], code, texts.get("stdout", ""), texts.get("stderr", ""))
