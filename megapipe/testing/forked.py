"""A Python script (or ``-m module``) run as ``__main__`` in a process of its own, forked from the server of
``worlds.py`` that has already imported torch, instead of in a new interpreter.

A new interpreter spends about three seconds of CPU importing torch (and ``torch._dynamo``) before the
script's first line; tests that start a script many times (to kill it at random moments and start it
again) pay that each time. The forked process is the script's own in every other way: its ``argv``,
environment and working directory, its output on a pipe the caller reads, its own session (so its
process group can be killed), and its exit status (``SystemExit`` as Python's; -9 once SIGKILLed). One
difference: like every ``multiprocessing`` process it ends without running ``atexit`` handlers, so a
script that relies on them is started as a new interpreter instead.

A forked torchrun (``python -m torch.distributed.run``) forks its workers from the same server too, unless
told not to (``fork_workers=False``: a test of what a new interpreter does at exit): torchrun starts each
worker as ``python -u script``, which costs those seconds again per rank. Such a worker is the server's
child, not torchrun's; where ``MEGAPIPE_WORKER_PIDS`` names a folder, torchrun writes each worker's pid
into the file named by its rank there, for callers that signal a rank.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
from typing import Optional

from megapipe.atomic_files import write_atomically
from megapipe.testing.hosts import enter
from megapipe.testing.worlds import preloaded_context

WORKER_PIDS = "MEGAPIPE_WORKER_PIDS"


def _run_script(argv: list[str], environ: dict, cwd: str, output, errors, server: Optional[str],
                namespace: Optional[str]) -> None:
    """In the forked process: enter the network ``namespace`` (a test host's) if given, become the script's
    own session with its output and errors on the pipes (``errors`` None: on the output's), then run it; a
    torchrun given the ``server``'s address forks its workers from that server, into the same namespace."""
    gc.freeze()  # what the server imported stays for the process's life: no collection need walk it
    if namespace is not None:
        enter(namespace)
    os.setsid()
    os.dup2(output.fileno(), 1)
    os.dup2((errors or output).fileno(), 2)
    for pipe in (output, errors):
        if pipe is not None:
            pipe.close()
    for stream in (sys.stdout, sys.stderr):  # line by line, as the callers read it (torchrun's workers run with -u)
        stream.reconfigure(line_buffering=True)
    os.environ.clear()  # the caller's environment, not the server's from when it started
    os.environ.update(environ)
    os.chdir(cwd)
    multiprocessing.current_process().daemon = False  # the script may start processes of its own, as when run directly
    if server is not None:
        _fork_torchrun_workers(server, namespace)
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


def _fork_torchrun_workers(server: str, namespace: Optional[str]) -> None:
    """In a forked torchrun: start each worker (``python -u script ...``, as torchrun builds it) as a process
    forked from the server at ``server`` (the one this process comes from, alive while the caller is),
    writing where torchrun would have it write."""
    from multiprocessing import forkserver, resource_tracker

    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    forkserver._forkserver._forkserver_address = server
    forkserver._forkserver.ensure_running = resource_tracker.ensure_running  # the server runs; never start another

    def fork_worker(handler: SubprocessHandler, args: tuple, env: dict) -> ForkedProcess:
        _python, _unbuffered, *argv = args
        outputs = [(stream or default).fileno() for stream, default in
                   ((handler._stdout, sys.stdout), (handler._stderr, sys.stderr))]
        worker = ForkedProcess(argv, env, os.getcwd(), outputs=outputs, namespace=namespace)
        if env.get(WORKER_PIDS):
            write_atomically(os.path.join(env[WORKER_PIDS], env["RANK"]), str(worker.pid))
        return worker

    def close(handler: SubprocessHandler, death_sig=None) -> None:
        """torchrun's ``close``, for a worker that the server reaps as soon as it exits: its process group may
        be gone before torchrun signals it (a new interpreter stays a zombie, and its group, until torchrun waits)."""
        try:
            torchrun_close(handler, death_sig)
        except ProcessLookupError:
            for stream in (handler._stdout, handler._stderr):
                if stream:
                    stream.close()

    torchrun_close = SubprocessHandler.close
    SubprocessHandler._popen, SubprocessHandler.close = fork_worker, close


def _server_address() -> str:
    """The address of the server that forks the processes here, started if it is not yet."""
    from multiprocessing import forkserver

    forkserver._forkserver.ensure_running()
    return forkserver._forkserver._forkserver_address


class ForkedProcess:
    """``subprocess.Popen``'s view of a forked script (``pid``, ``stdout`` and ``stderr`` as text, ``poll``,
    ``wait``, ``returncode``); with ``merge_errors`` its errors come on ``stdout``, as with ``stderr=STDOUT``.
    With ``outputs`` (two file descriptors) it writes to those instead, and ``stdout`` and ``stderr`` are None.
    With ``fork_workers`` a forked torchrun forks its workers too. With ``namespace`` the script (and a
    torchrun's workers) runs inside that network namespace, as under ``ip netns exec`` (``testing/hosts.py``)."""

    def __init__(self, argv: list[str], env: dict, cwd: str, merge_errors: bool = True,
                 outputs: Optional[list[int]] = None, fork_workers: bool = True, namespace: Optional[str] = None):
        self.args = argv
        context = preloaded_context()
        if outputs is not None:  # handed to the child as a pipe's end would be
            pipes, writers = [], [multiprocessing.connection.Connection(os.dup(fd), readable=False) for fd in outputs]
        else:
            pipes = [context.Pipe(duplex=False) for _ in range(1 if merge_errors else 2)]
            writers = [writer for _, writer in pipes] + [None] * merge_errors
        server = _server_address() if fork_workers and argv[:2] == ["-m", "torch.distributed.run"] else None
        if server is not None and namespace is not None and server.startswith("\0"):
            server = None  # an abstract socket is per network namespace: from inside a host, torchrun's own workers
        self._process = context.Process(target=_run_script, args=(argv, env, cwd, *writers, server, namespace),
                                        daemon=True)
        self._process.start()
        self.pid = self._process.pid
        for writer in writers if outputs is not None else []:
            writer.close()
        readers = []
        for reader, writer in pipes:
            writer.close()  # the child holds the only write end: the pipe ends when it does
            readers.append(os.fdopen(os.dup(reader.fileno()), "r"))
            reader.close()
        self.stdout, self.stderr = (readers + [None, None])[:2]

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
