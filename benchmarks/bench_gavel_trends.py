"""The chapter's simulated trends on generated traces (seed 002 sections 5.7.3 and 6.4).

    python benchmarks/bench_gavel_trends.py [--gpus-per-type 12] [--num-jobs 1000] [--parts las,ftf,makespan,cost]

Reduction, stated: a cluster of 12 GPUs of each type (the chapter: 36) and traces of --num-jobs
jobs (the chapter: at least 5000, measuring jobs 4000-5000) with the average JCT taken over the
middle 30% of job ids; input rates scaled by the cluster size. One seed per point.

- las: continuous-single trace, LAS against heterogeneity-aware LAS over a sweep of input rates
  (picture: benchmarks/results/gavel_jct_vs_load.png);
  the sustainable load is the highest rate whose average JCT stays within twice the lightest-load
  JCT of the aware policy, and the ratio of the two sustainable loads is reported (chapter: the
  aware policy sustains higher load; JCT 3.5x better at high load).
- ftf: continuous-multiple trace, finish-time fairness agnostic vs aware (chapter: JCT 3x, FTF 2.8x).
- makespan: static single- and multi-worker traces, makespan policy agnostic / aware / FIFO /
  Gandiva (chapter: 2.5x better than FIFO, 1.4x than Gandiva); the multi-worker trace also with
  the mechanism's single priority queue across types (--global-queue).
- cost: ResNet-50 and A3C jobs of 0.5-8 days (on a V100) arriving hourly, with SLOs of
  1.2x/2x/10x that duration, on up to 64 rented instances of each type, maximum
  throughput vs minimum cost vs minimum cost with SLOs, at GCP on-demand and spot prices
  (chapter: minimum cost 1.4x cheaper with about 35% SLO violations; with SLOs 1.2x cheaper and
  no violations).
"""

from __future__ import annotations

import os
import random
import sys
import time

from tqdm import tqdm

from harness import cli, report
from benchmarks.gavel_common import DATA, run_policy
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.sim.plots import plot_jct_vs_load
from megapipe.cluster.core.throughputs import ThroughputTable
from megapipe.cluster.sim.trace import generate_trace

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ON_DEMAND = {"v100": 2.48, "p100": 1.46, "k80": 0.45}  # GCP $/GPU-hour
SPOT = {"v100": 0.74, "p100": 0.43, "k80": 0.135}  # GCP preemptible $/GPU-hour


def window_of(num_jobs: int) -> tuple[int, int]:
    return int(0.35 * num_jobs), int(0.65 * num_jobs)


def stop_after(window):
    return lambda s: len(s.records) >= window[1] and all(s.records[i].finish_time is not None for i in range(*window))


def las_sweep(table, cluster, num_jobs, rates, bar):
    window, results = window_of(num_jobs), {}
    for rate in rates:
        jobs = generate_trace(table, num_jobs, rate, seed=0)
        for policy in ("max_min_fairness", "max_min_fairness_perf"):
            _, summary = run_policy(policy, jobs, table, cluster, 0, window, stop_when=stop_after(window))
            results[(policy, rate)] = summary.average_jct_hours
            bar.update()
    print("\nLAS, continuous-single: average JCT (h) by input rate (jobs/h)")
    print("\n".join(report.markdown(
        ["rate", "LAS", "heterogeneity-aware LAS", "ratio"],
        ([f"{rate:g}", f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}"] for rate, a, b in
         ((rate, results[("max_min_fairness", rate)], results[("max_min_fairness_perf", rate)]) for rate in rates)))))
    bound = 2 * results[("max_min_fairness_perf", rates[0])]
    sustained = {p: max([r for r in rates if results[(p, r)] <= bound], default=0.0)
                 for p in ("max_min_fairness", "max_min_fairness_perf")}
    ratio = sustained["max_min_fairness_perf"] / sustained["max_min_fairness"] if sustained["max_min_fairness"] else float("inf")
    plot_jct_vs_load({p: [(r, results[(p, r)]) for r in rates] for p in ("max_min_fairness", "max_min_fairness_perf")},
                     os.path.join(RESULTS, "gavel_jct_vs_load.png"))
    print(f"sustainable load (JCT <= {bound:.1f} h): LAS {sustained['max_min_fairness']:g}, aware "
          f"{sustained['max_min_fairness_perf']:g} jobs/h; ratio {ratio:.2f} (chapter: higher load sustained, 1.5x headline)")


def ftf(table, cluster, num_jobs, rate, bar):
    window = window_of(num_jobs)
    jobs = generate_trace(table, num_jobs, rate, seed=1, multi_worker=True)
    out = {}
    for policy in ("finish_time_fairness", "finish_time_fairness_perf"):
        out[policy] = run_policy(policy, jobs, table, cluster, 0, window, stop_when=stop_after(window))[1]
        bar.update()
    a, b = out["finish_time_fairness"], out["finish_time_fairness_perf"]
    print(f"\nFTF, continuous-multiple at {rate:g} jobs/h: average JCT {a.average_jct_hours:.1f} h -> "
          f"{b.average_jct_hours:.1f} h ({a.average_jct_hours / b.average_jct_hours:.2f}x); average FTF "
          f"{a.average_ftf:.2f} -> {b.average_ftf:.2f} ({a.average_ftf / b.average_ftf:.2f}x) (chapter: 3x, 2.8x)")


def makespan(table, cluster, num_jobs, bar, multi_worker, global_queue=False):
    jobs = generate_trace(table, num_jobs, 0, seed=2, multi_worker=multi_worker)
    out = {}
    for policy in ("fifo", "gandiva", "min_total_duration", "min_total_duration_perf"):
        out[policy] = run_policy(policy, jobs, table, cluster, global_queue=global_queue)[1].makespan_hours
        bar.update()
    best = out["min_total_duration_perf"]
    order = "one queue across types" if global_queue else "type by type"
    print(f"\nmakespan, {num_jobs} static {'multi' if multi_worker else 'single'}-worker jobs, mechanism {order}: " + ", ".join(f"{p} {h:.1f} h" for p, h in out.items())
          + f"; aware vs FIFO {out['fifo'] / best:.2f}x, vs Gandiva {out['gandiva'] / best:.2f}x, "
          f"vs agnostic {out['min_total_duration'] / best:.2f}x (chapter: 2.5x, 1.4x)")


def cost_jobs(table, num_jobs, seed=3):
    rng = random.Random(seed)
    types = ["ResNet-50 (batch size 64)", "A3C"]
    jobs, now = [], 0.0
    for job_id in range(num_jobs):
        job_type = rng.choice(types)
        days = rng.choice([0.5, 1, 2, 4, 8])
        duration = days * 86400  # on a V100, alone
        steps = int(duration * table.alone(job_type, 1, "v100"))
        jobs.append(Job(job_id, job_type, steps, arrival_time=round(now), slo=rng.choice([1.2, 2.0, 10.0]) * duration))
        now += rng.expovariate(1 / 3600.0)
    return jobs


def cost(table, num_jobs, bar):
    """Cloud instances are elastic: enough of every type that no job waits, so cost follows the policy."""
    cluster = "v100:64,p100:64,k80:64"
    jobs = cost_jobs(table, num_jobs)
    print(f"\ncost, {num_jobs} ResNet-50 / A3C jobs with SLOs, up to 64 instances of each type:")
    print("\n".join(report.markdown(["prices", "policy", "cost ($)", "SLO violations", "cost vs max throughput"])))
    for label, prices in (("on-demand", ON_DEMAND), ("spot", SPOT)):
        rows = {}
        for policy in ("max_sum_throughput_perf", "max_sum_throughput_normalized_by_cost_perf",
                       "max_sum_throughput_normalized_by_cost_perf_SLOs"):
            rows[policy] = run_policy(policy, jobs, table, cluster, 0, prices=prices)[1]
            bar.update()
        base = rows["max_sum_throughput_perf"].total_cost
        for policy, s in rows.items():
            print(f"| {label} | `{policy}` | {s.total_cost:,.0f} | {100 * s.slo_violations / max(s.jobs_with_slo, 1):.0f}% "
                  f"| {base / s.total_cost:.2f}x cheaper |")


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--gpus-per-type", type=int, default=12)
    parser.add_argument("--num-jobs", type=int, default=1000)
    parser.add_argument("--rates", default="0.5,1,1.5,2,2.5,3", help="jobs/h for the LAS sweep")
    parser.add_argument("--parts", default="las,ftf,makespan,cost")
    args = parser.parse_args()
    started = time.perf_counter()
    table = ThroughputTable.load(DATA + "simulation_throughputs.json")
    n = args.gpus_per_type
    cluster = f"v100:{n},p100:{n},k80:{n}"
    rates = [float(r) for r in args.rates.split(",")]
    parts = args.parts.split(",")
    steps = 2 * len(rates) * ("las" in parts) + 2 * ("ftf" in parts) + 12 * ("makespan" in parts) + 6 * ("cost" in parts)
    print(f"cluster {cluster}, {args.num_jobs} jobs per trace")
    with tqdm(total=steps, desc="simulations", file=sys.stderr) as bar:
        if "las" in parts:
            las_sweep(table, cluster, args.num_jobs, rates, bar)
        if "ftf" in parts:
            ftf(table, cluster, args.num_jobs, rates[len(rates) // 2] / 2, bar)
        if "makespan" in parts:
            makespan(table, cluster, 100, bar, multi_worker=False)
            makespan(table, cluster, 100, bar, multi_worker=True)
            makespan(table, cluster, 100, bar, multi_worker=True, global_queue=True)
        if "cost" in parts:
            cost(table, 100, bar)
    print(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
