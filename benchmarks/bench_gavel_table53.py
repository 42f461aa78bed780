"""Seed 002 Table 5.3, simulated column: our simulator on the original traces, next to the chapter.

    python benchmarks/bench_gavel_table53.py

Cluster 8 V100, 16 P100, 24 K80 (8 GPUs per server), 6-minute rounds, the original system's
simulation throughputs. Continuous trace (96 jobs over about 13 hours): average JCT of the 25
jobs in the middle of the trace (ids 35-59, tools/cluster.py's default window) under LAS and
heterogeneity-aware LAS. Static trace (100 jobs at time 0): makespan of the heterogeneity-aware
makespan policy and of Gandiva's ad-hoc space sharing. Randomised baselines (LAS visits the
accelerator types in a shuffled order, Gandiva pairs at random) are the mean of seeds 0-2. The
average over every job, and over every window of 25 consecutive jobs, is printed for context.
With ``--pop-partitions K`` the policies POP can split are solved as K parts (Gandiva's random
pairing has nothing to split and runs whole).
"""

from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

from harness import cli, report  # first: it puts the checkout on the path
from benchmarks.gavel_common import DATA, run_policy
from megapipe.cluster.core.policies import make_policy
from megapipe.cluster.sim.metrics import summarise
from megapipe.cluster.core.throughputs import ThroughputTable
from megapipe.cluster.sim.trace import read_trace

CLUSTER = "v100:8,p100:16,k80:24"
ROWS = [  # (trace, system, policy, objective, chapter hours, seeds)
    ("continuous", "Gavel", "max_min_fairness_perf", "average JCT", 3.7, (0,)),
    ("continuous", "LAS", "max_min_fairness", "average JCT", 5.4, (0, 1, 2)),
    ("static", "Gavel", "min_total_duration_perf", "makespan", 17.6, (0,)),
    ("static", "Gandiva", "gandiva", "makespan", 22.1, (0, 1, 2)),
]
TRACES = {"continuous": "max_min_fairness.trace", "static": "minimize_makespan.trace"}
WINDOW = (35, 60)


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--pop-partitions", type=int, default=1, metavar="K")
    args = parser.parse_args()
    started = time.perf_counter()
    table = ThroughputTable.load(DATA + "simulation_throughputs.json")
    results = []
    for trace, system, policy, objective, chapter, seeds in tqdm(ROWS, desc="Table 5.3", unit="row"):
        jobs = read_trace(DATA + TRACES[trace], table)
        values, everyone, windows = [], [], []
        for seed in seeds:
            parts = 1 if make_policy(policy).unpartitionable else args.pop_partitions
            scheduler, summary = run_policy(policy, jobs, table, CLUSTER, seed, WINDOW, pop_partitions=parts)
            values.append(summary.average_jct_hours if objective == "average JCT" else summary.makespan_hours)
            everyone.append(summarise(scheduler).average_jct_hours)
            windows.append([summarise(scheduler, (s, s + 25)).average_jct_hours for s in range(0, len(jobs) - 24)])
        results.append((trace, system, policy, objective, chapter, values, float(np.mean(everyone)),
                        np.mean(windows, axis=0)))
    rows = []
    for trace, system, policy, objective, chapter, values, everyone, _ in results:
        ours = float(np.mean(values))
        spread = f" (seeds {', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else ""
        rows.append([trace, system, f"`{policy}`", objective, f"{chapter:.1f} h", f"{ours:.2f} h{spread}",
                     f"{ours / chapter:.3f}"])
    report.print_markdown(["trace", "system", "policy", "objective", "chapter (simulated)", "ours", "ours / chapter"],
                          rows)
    print("\ncontinuous trace, average JCT over all 96 jobs: "
          + ", ".join(f"{r[2]} {r[6]:.2f} h" for r in results if r[0] == "continuous"))
    for r in results:
        if r[0] == "continuous":
            print(f"{r[2]}: 25-job windows range {r[7].min():.2f}-{r[7].max():.2f} h (median {np.median(r[7]):.2f})")
    jct = {r[2]: np.mean(r[5]) for r in results}
    print(f"ratios: LAS / Gavel JCT {jct['max_min_fairness'] / jct['max_min_fairness_perf']:.2f} (chapter 1.46); "
          f"Gandiva / Gavel makespan {jct['gandiva'] / jct['min_total_duration_perf']:.2f} (chapter 1.26)")
    print(f"took {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
