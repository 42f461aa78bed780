"""How every backend starts one host's ranks of a job: torchrun, with SIGTERM left to the workers.

A backend stops a job by sending SIGTERM to every process of it on a host (a worker agent
signals the job's process group, Slurm the task's process tree), torchrun included. torchrun
would answer by forwarding it to its workers, killing them 30 s later and exiting with an error,
which cuts off a longer save. So it runs with SIGTERM ignored (``trap '' TERM`` before ``exec``)
and without its own handler for it (``--signals-to-handle`` without SIGTERM): the workers
install the training loop's handler, save at the next iteration boundary and exit 0, and
torchrun then exits 0 as after any successful run. (A worker inherits the ignored SIGTERM until
the first line of its script installs the handler, ``training/sigterm.py``; one that arrives
before is lost, and the lease, answered ``stop``, ends the run.)
"""

from __future__ import annotations

import shlex

SIGNALS_TORCHRUN_HANDLES = "SIGINT,SIGHUP,SIGQUIT"  # torchrun's default list without SIGTERM


def node_shell_command(python: str, nodes: int, devices: int, node_rank: str, endpoint: str, run_id: str,
                       command: list[str]) -> str:
    """The shell line that runs one host's ranks of ``command`` (``[script, flags...]``).

    ``node_rank``, ``endpoint`` (HOST:PORT of the static rendezvous on the first host) and
    ``run_id`` are shell words: a value quoted with ``shlex.quote``, or ``"$VAR"`` that the shell
    on the node expands (as the Slurm batch script does)."""
    torchrun = [python, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(devices),
                "--rdzv-backend", "static", "--signals-to-handle", SIGNALS_TORCHRUN_HANDLES]
    return (f"trap '' TERM; exec {shlex.join(torchrun)} --node-rank {node_rank} --rdzv-endpoint {endpoint} "
            f"--rdzv-id {run_id} {shlex.join(command)}")
