"""A 2,048-job continuous trace replayed through every policy: solve time per reallocation, and JCT.

    python benchmarks/bench_gavel_scale_simulation.py [--num-jobs 2048] [--jobs-per-hour 24]
        [--cluster v100:128,p100:128,k80:128] [--pop-partitions 1] [--policies all]

The trace comes from the chapter's generator (``tools/cluster.py generate-trace``: Poisson
arrivals, the chapter's job durations, single-worker jobs uniform over the 26 types). The cluster
is 384 GPUs, ten times the chapter's 36 per type, and the arrival rate scaled with it, so that
hundreds of jobs are active at once. Per policy: reallocations, solve seconds per reallocation
(mean, 95th percentile, max), the largest number of active jobs, the average JCT over the middle
30% of job ids, and the whole replay's wall time.
"""

from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

from harness import cli, report
from benchmarks.gavel_common import DATA
from megapipe.cluster.core.cluster_spec import parse_cluster
from megapipe.cluster.core.policies import POLICY_NAMES, make_policy
from megapipe.cluster.core.scheduler import Scheduler
from megapipe.cluster.core.throughputs import ThroughputTable
from megapipe.cluster.sim.metrics import summarise
from megapipe.cluster.sim.simulator import simulate
from megapipe.cluster.sim.trace import generate_trace

PRICES = {"v100": 2.48, "p100": 1.46, "k80": 0.45}  # the cost policies' $/GPU-hour (GCP on-demand)


class ActiveCount:
    """Largest number of active jobs seen at a reallocation."""

    def __init__(self, scheduler):
        self.scheduler, self.largest = scheduler, 0

    def __call__(self, _):
        self.largest = max(self.largest, len(self.scheduler.active))
        return False


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--num-jobs", type=int, default=2048)
    parser.add_argument("--jobs-per-hour", type=float, default=24.0)
    parser.add_argument("--cluster", default="v100:128,p100:128,k80:128")
    parser.add_argument("--pop-partitions", type=int, default=1)
    parser.add_argument("--policies", default="all", help="comma-separated names, or all")
    args = parser.parse_args()
    table = ThroughputTable.load(DATA + "simulation_throughputs.json")
    jobs = generate_trace(table, args.num_jobs, args.jobs_per_hour, seed=0)
    names = POLICY_NAMES if args.policies == "all" else args.policies.split(",")
    window = (int(0.35 * len(jobs)), int(0.65 * len(jobs)))
    rows = []
    for name in tqdm(names, desc="policies", unit="policy"):
        partitions = args.pop_partitions if not make_policy(name).unpartitionable else 1
        scheduler = Scheduler(make_policy(name, pop_partitions=partitions), table,
                              parse_cluster(args.cluster, 8), prices=PRICES)
        active = ActiveCount(scheduler)
        started = time.perf_counter()
        simulate(scheduler, jobs, stop_when=active)
        wall = time.perf_counter() - started
        solves = np.array(scheduler.solve_seconds)
        rows.append([f"`{name}`", partitions, len(solves), f"{solves.mean():.3f}", f"{np.percentile(solves, 95):.3f}",
                     f"{solves.max():.3f}", active.largest, f"{summarise(scheduler, window).average_jct_hours:.1f}",
                     f"{wall:.0f}"])
        close = getattr(scheduler.policy, "close", None)
        if close:
            close()
    print(f"{len(jobs)} jobs over {jobs[-1].arrival_time / 3600:.0f} h on {args.cluster}")
    report.print_markdown(["policy", "POP parts", "reallocations", "solve mean (s)", "solve p95 (s)", "solve max (s)",
                           "most active jobs", "average JCT (h)", "replay (s)"], rows)


if __name__ == "__main__":
    main()
