"""Shared helpers of the Gavel benchmarks: run one policy on a list of jobs and summarise it."""

from __future__ import annotations

from pathlib import Path

from megapipe.cluster.core.cluster_spec import parse_cluster
from megapipe.cluster.sim.metrics import summarise
from megapipe.cluster.core.policies import make_policy
from megapipe.cluster.core.scheduler import Scheduler
from megapipe.cluster.sim.simulator import simulate

DATA = str(Path(__file__).resolve().parents[1] / "megapipe" / "cluster" / "data") + "/"


def run_policy(policy: str, jobs, table, cluster: str, seed: int = 0, window=None, prices=None,
               stop_when=None, gpus_per_server: int = 8, global_queue: bool = False, pop_partitions: int = 1):
    scheduler = Scheduler(make_policy(policy, seed, pop_partitions), table, parse_cluster(cluster, gpus_per_server),
                          seed=seed, prices=prices or {}, global_queue=global_queue)
    simulate(scheduler, [job for job in jobs], stop_when=stop_when)
    if pop_partitions > 1:
        scheduler.policy.close()
    return scheduler, summarise(scheduler, window)
