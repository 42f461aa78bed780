"""How long policies take to solve as the number of active jobs grows (seed 002 section 5.7.4, Figure 5.14).

    python benchmarks/bench_gavel_solve_time.py [--jobs 32,128,512,2048] [--packed-jobs 32,64,128]

Jobs are drawn uniformly from the 26 types (single worker), on a cluster that grows with them:
n/4 GPUs of each of V100, P100 and K80. Times cover building the problem and solving it
(cvxpy compilation included), one run each. The chapter: with 2048 jobs the hierarchical policy
without space sharing solves in under 10 minutes, the single-level LAS policy much faster; with
space sharing 512 jobs take under 10 minutes.
"""

from __future__ import annotations

import random
import time

from harness import cli, report
from benchmarks.gavel_common import DATA
from megapipe.cluster.core.cluster_spec import ClusterSpec
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.policies import make_policy
from megapipe.cluster.core.policies.water_filling import WaterFilling
from megapipe.cluster.core.problem import build_problem
from megapipe.cluster.core.throughputs import ThroughputTable


def jobs_for(table, n, seed=0, entities=4):
    rng = random.Random(seed)
    types = sorted(t for t in table.job_types() if table.alone(t, 1, "v100") > 0)
    return [Job(i, rng.choice(types), rng.randint(10_000, 1_000_000), entity=f"e{i % entities}") for i in range(n)]


def timed(policy, jobs, table, cluster) -> float:
    started = time.perf_counter()
    problem = build_problem(jobs, table, cluster, space_sharing=policy.space_sharing)
    policy.allocate(problem)
    return time.perf_counter() - started


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--jobs", default="32,128,512,2048")
    parser.add_argument("--packed-jobs", default="32,64,128")
    args = parser.parse_args()
    table = ThroughputTable.load(DATA + "simulation_throughputs.json")
    policies = {
        "max_min_fairness_perf": lambda: make_policy("max_min_fairness_perf"),
        "min_total_duration_perf": lambda: make_policy("min_total_duration_perf"),
        "hierarchical (water filling, 4 entities)": lambda: WaterFilling(entity_weights={"e0": 1, "e1": 2, "e2": 3, "e3": 4}),
        "max_min_fairness_packed": lambda: make_policy("max_min_fairness_packed"),
    }
    print("\n".join(report.markdown(["policy", "active jobs", "GPUs", "seconds"])))
    for name, factory in policies.items():
        sizes = args.packed_jobs if "packed" in name else args.jobs
        for n in (int(s) for s in sizes.split(",")):
            cluster = ClusterSpec({"v100": max(n // 4, 1), "p100": max(n // 4, 1), "k80": max(n // 4, 1)})
            seconds = timed(factory(), jobs_for(table, n), table, cluster)
            print(report.markdown_row([name, n, cluster.total, f"{seconds:.2f}"]), flush=True)


if __name__ == "__main__":
    main()
