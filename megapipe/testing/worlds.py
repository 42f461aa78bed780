"""Run a function on N real processes (gloo on CPU) and collect results; never hang.

Used by the tests and by benchmarks that need a fresh world without ``torchrun``::

    def check(rank, world_size, scale):        # module-level, so that it pickles
        ...
        return value

    results = run_distributed(4, check, 2.0)   # one value per rank
    results = run_distributed(4, check, 2.0, hosts=test_hosts)   # ranks 0-1 in host 0, 2-3 in host 1

A rank that raises makes ``run_distributed`` raise ``DistributedFailure`` naming the rank
and carrying its traceback; the other ranks are killed. A world that does not finish within
``timeout`` seconds is killed and reported the same way.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class DistributedFailure(RuntimeError):
    """A rank raised or the world did not finish in time."""


def _worker(rank: int, world_size: int, environ: dict, address: str, port: int, namespace: Optional[str],
            collective_timeout: float, call: bytes, results: "mp.Queue") -> None:
    gc.freeze()  # what the server imported stays for the process's life: no collection need walk it (``preloaded_context``)
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        if namespace is not None:
            from megapipe.testing.hosts import INTERFACE, enter

            enter(namespace)
            os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE
        timeout = datetime.timedelta(seconds=collective_timeout)
        store = dist.TCPStore(address, port, world_size, False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        fn, args = pickle.loads(call)
        value = fn(rank, world_size, *args)
        # pickled by value here: a tensor put on the queue as it is travels as a shared-memory
        # handle that the parent can only open while this process is alive
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # report everything, including SystemExit from argparse
        results.put((rank, "error", traceback.format_exc()))
        # in the pipe before this rank's connections close: a peer that then fails on the closed
        # connection reports after it, so the parent names this rank's error, the cause
        results.close()
        results.join_thread()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def preloaded_context():
    """Processes forked from a server that has imported torch (the worlds here, ``forked.py``'s scripts):
    each starts in a tenth of a second instead of importing torch again (about a second of CPU each), and
    torch._dynamo (about as long again; the first optimizer step imports it, and megapipe imports it
    before a process group exists, ``parallel/launch.py``), and the Trainer's and torchrun's modules (a
    quarter of a second more each; ``MEGAPIPE_TIMEOUT``, the one variable a module of megapipe reads
    when imported, is the server's). The server imports and computes nothing else, so no thread pool
    is forked (what makes plain ``fork`` unsafe here)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "megapipe.training.trainer",
                                "torch.distributed.run"])
    return ctx


def run_distributed(world_size: int, fn: Callable, *args: Any, timeout: float = 180.0,
                    collective_timeout: float = 60.0, hosts=None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes.

    With ``hosts`` (``megapipe.testing.hosts.TestHosts``) the ranks are spread over them in
    consecutive blocks of ``world_size / len(hosts)``, each process inside its host, talking
    to the others through the hosts' links.

    Returns the per-rank return values (they must be picklable). Raises
    ``DistributedFailure`` with the first failing rank's traceback, or on timeout.
    """
    ctx = preloaded_context()
    results = ctx.Queue()
    # the parent holds the rendezvous store on a port the system picks, so no other process can
    # take the port between choosing and binding it (ranks connect to it as clients)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # listens on every interface
    port = store.port
    address, namespaces = "127.0.0.1", [None] * world_size
    if hosts is not None:
        if world_size % len(hosts):
            raise ValueError(f"{world_size} ranks do not spread evenly over {len(hosts)} hosts")
        per_host = world_size // len(hosts)
        address, namespaces = hosts.gateway, [hosts[r // per_host].namespace for r in range(world_size)]
    # the function and its arguments travel by value: tensors handed over as shared-memory handles
    # would each take a file descriptor, and a fork server accepts at most 256 of those per process
    call = pickle.dumps((fn, args))
    environ = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, environ, address, port, namespaces[r],
                                               collective_timeout, call, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise DistributedFailure(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s; "
                                         "a collective or p2p call is probably waiting on a peer.")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                if dead:
                    raise DistributedFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                             "without reporting a result.")
                continue
            if status == "error":
                raise DistributedFailure(f"rank {rank} of {world_size} failed:\n{value}{_crashed(procs, rank)}")
            values[rank] = pickle.loads(value)
        grace = time.monotonic() + 5.0  # results are in; a teardown stuck on a closed connection is killed
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
    return [values[r] for r in range(world_size)]


def _crashed(procs: list, reporting: int) -> str:
    """A line naming another rank that died without reporting (a crash or a kill, the likely cause of
    the reporting rank's lost connection), once each has had up to two seconds to end."""
    for rank, p in enumerate(procs):
        if rank != reporting:
            p.join(timeout=2)
            if p.exitcode not in (None, 0):
                return f"\n(rank {rank} died with exit code {p.exitcode} without reporting, probably the cause of the error above)"
    return ""
