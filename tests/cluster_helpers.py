"""Small throughput tables and jobs for the Gavel tests, and tools/cluster.py loaded as a module."""

import importlib.util
from pathlib import Path

from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.throughputs import ThroughputTable
from launch_helpers import REPO

ROOT = Path(REPO)
DATA = str(ROOT / "megapipe" / "cluster" / "data") + "/"


def load_cluster_tool():
    spec = importlib.util.spec_from_file_location("cluster_tool", ROOT / "tools" / "cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_table() -> ThroughputTable:
    """Three job types on v100/p100/k80, single and two-worker, with co-location entries."""
    table = ThroughputTable()
    rows = {"a": (40.0, 20.0, 10.0), "b": (12.0, 8.0, 4.0), "c": (100.0, 70.0, 50.0)}
    for name, (v100, p100, k80) in rows.items():
        table.add_job_type(name, 1, {"v100": v100, "p100": p100, "k80": k80})
        table.add_job_type(name, 2, {"v100": 1.8 * v100, "p100": 1.8 * p100, "k80": 1.9 * k80})
    for worker, index in (("v100", 0), ("p100", 1), ("k80", 2)):
        for first in rows:
            for second in rows:
                share = 0.6 if first != second else 0.5
                table.pairs.setdefault(worker, {})[((first, 1), (second, 1))] = (
                    share * rows[first][index], share * rows[second][index])
    return table


def small_jobs() -> list[Job]:
    return [Job(0, "a", 4000, 1, arrival_time=0), Job(1, "b", 3000, 1, priority_weight=2.0, arrival_time=0),
            Job(2, "c", 9000, 2, arrival_time=0, slo=4000.0), Job(3, "a", 2000, 1, arrival_time=0),
            Job(4, "c", 5000, 1, arrival_time=0)]
