"""How long policies take to solve as the number of active jobs grows (seed 002 section 5.7.4, Figure 5.14),
next to the original Gavel's times on the same jobs, POP's parts, and the round time of incremental rounds.

    python benchmarks/bench_gavel_solve_time.py [--jobs 32,128,512,2048] [--packed-jobs 32,128,512,2048]
        [--pop-jobs 2048,10000] [--pop-partitions 1,4,16]

Jobs are drawn uniformly from the 26 types (single worker, four entities), on a cluster that grows
with them: n/4 GPUs of each of V100, P100 and K80. Times cover building the problem and solving
it, one run each, every case in a fresh process whose peak memory (with its POP workers') is
reported. The original's column holds its times measured side by side on the same jobs (2,048
jobs; space sharing at the sizes named). Tables:

1. every policy against the number of jobs, with the original's time;
2. the objective of what is compared: space sharing over a few partners per job against every
   pair, and hierarchical water filling run to the end against the same stopped after 2
   iterations, where the original stops at 2,048 jobs;
3. POP: time (first call, which starts the worker processes, and a re-solve of every part) and
   objective against the whole problem's for k parts;
4. incremental rounds: a service round (reallocation and the round's placements) at 2,048 active
   jobs after one arrival, whole and with POP (only the arrival's part is solved again).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import resource
import time

import numpy as np

from harness import cli, report
from benchmarks.gavel_common import DATA
from megapipe.cluster.core.cluster_spec import ClusterSpec
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.policies import make_policy
from megapipe.cluster.core.policies.water_filling import WaterFilling
from megapipe.cluster.core.problem import build_problem
from megapipe.cluster.core.scheduler import Scheduler
from megapipe.cluster.core.throughputs import ThroughputTable

ENTITY_WEIGHTS = {"e0": 1, "e1": 2, "e2": 3, "e3": 4}
HIERARCHICAL = "hierarchical (water filling, 4 entities)"
POLICIES = ["max_min_fairness", "max_min_fairness_perf", "min_total_duration_perf", "finish_time_fairness_perf",
            HIERARCHICAL, "max_min_fairness_packed"]
ORIGINAL = {  # the original Gavel's seconds on the same jobs, measured side by side (2,048 jobs unless keyed by size)
    "max_min_fairness": {2048: "0.05"}, "max_min_fairness_perf": {2048: "0.06"},
    "min_total_duration_perf": {2048: "0.23"}, "finish_time_fairness_perf": {2048: "7.9"},
    HIERARCHICAL: {2048: "4.6 (stops after 2 iterations)"},
    "max_min_fairness_packed": {512: "43", 1024: "531", 2048: "cannot run (its pair matrix needs 48 GiB)"},
}


def jobs_for(table, n, seed=0, entities=4):
    rng = random.Random(seed)
    types = sorted(t for t in table.job_types() if table.alone(t, 1, "v100") > 0)
    return [Job(i, rng.choice(types), rng.randint(10_000, 1_000_000), entity=f"e{i % entities}", arrival_time=i)
            for i in range(n)]


def cluster_for(n: int) -> ClusterSpec:
    return ClusterSpec({"v100": max(n // 4, 1), "p100": max(n // 4, 1), "k80": max(n // 4, 1)})


def policy_named(name: str, partitions: int = 1, max_iterations=None):
    if name == HIERARCHICAL:
        return WaterFilling(entity_weights=ENTITY_WEIGHTS, max_iterations=max_iterations)
    return make_policy(name, pop_partitions=partitions)


def peak_gib() -> float:
    """Peak resident memory of this process or of any worker it waited for, in GiB (ru_maxrss is KiB)."""
    return max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 2**20


def solve_case(name: str, n: int, partners="default", partitions: int = 1, max_iterations=None) -> dict:
    """One solve in this process: seconds, objective, peak memory (and with POP a second, warm solve)."""
    warm_up()
    table = ThroughputTable.load(DATA + "simulation_throughputs.json")
    jobs, cluster = jobs_for(table, n), cluster_for(n)
    policy = policy_named(name, partitions, max_iterations)
    partners = policy.partners if partners == "default" else partners
    started = time.perf_counter()
    problem = build_problem(jobs, table, cluster, space_sharing=policy.space_sharing, partners=partners,
                            groups=policy.pair_groups(jobs))
    x = policy.allocate(problem)
    result = {"seconds": time.perf_counter() - started, "objective": objective(policy, problem, x)}
    if partitions > 1:
        policy.solved = {}  # every part again, on the started workers
        started = time.perf_counter()
        policy.allocate(build_problem(jobs, table, cluster, space_sharing=policy.space_sharing, partners=partners,
                                      groups=policy.pair_groups(jobs)))
        result["warm"] = time.perf_counter() - started
        policy.close()
    return {**result, "gib": peak_gib()}


def objective(policy, problem, x) -> float:
    if isinstance(policy, WaterFilling):  # water filling maximises the least normalised throughput first
        scale = np.array([job.scale_factor for job in problem.jobs], dtype=float)
        return float((problem.throughput(x) * scale / problem.equal_share()).min())
    return policy.objective(problem, x)


def round_case(n: int, partitions: int) -> dict:
    """A service round at n active jobs after one arrival: reallocation (problem, solve, mechanism reset) and plan."""
    warm_up()
    table = ThroughputTable.load(DATA + "simulation_throughputs.json")
    jobs = jobs_for(table, n + 1)
    scheduler = Scheduler(make_policy("max_min_fairness_perf", pop_partitions=partitions), table, cluster_for(n),
                          reallocation_seconds=0.0)
    for job in jobs[:n]:
        scheduler.add_job(job)
    scheduler.maybe_reallocate(0.0)
    scheduler.plan_round()
    scheduler.add_job(jobs[n])
    started = time.perf_counter()
    scheduler.maybe_reallocate(360.0)
    scheduler.plan_round()
    result = {"seconds": time.perf_counter() - started, "solve": scheduler.solve_seconds[-1], "gib": peak_gib()}
    if partitions > 1:
        scheduler.policy.close()
    return result


def warm_up() -> None:
    """Import the solvers before timing, as a running scheduler has them."""
    import cvxpy  # noqa: F401

    from megapipe.cluster.core.lp import _highspy

    _highspy()


def _run_into(queue, function, args, kwargs) -> None:
    queue.put(function(*args, **kwargs))


def fresh(function, *args, **kwargs) -> dict:
    """``function`` run in a new process, so that its peak memory is its own."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_run_into, args=(queue, function, args, kwargs))
    process.start()
    result = queue.get()
    process.join()
    return result


def solve_times(sizes: dict) -> None:
    rows = []
    for name in POLICIES:
        for n in sizes["packed" if "packed" in name else "plain"]:
            result = fresh(solve_case, name, n)
            rows.append([f"`{name}`" if name != HIERARCHICAL else name, n, cluster_for(n).total,
                         f"{result['seconds']:.3f}", ORIGINAL[name].get(n, ""), f"{result['gib']:.2f}"])
    report.print_markdown(["policy", "active jobs", "GPUs", "megapipe (s)", "original (s)", "peak memory (GiB)"], rows)


def objectives(packed_sizes: list) -> None:
    rows = []
    for n in packed_sizes:
        pruned = fresh(solve_case, "max_min_fairness_packed", n)
        every = fresh(solve_case, "max_min_fairness_packed", n, partners=None) if n <= 512 else None
        rows.append([f"space sharing, {n} jobs", "least normalised throughput", f"{pruned['objective']:.4f}",
                     "-" if every is None else f"{every['objective']:.4f} (every pair, {every['seconds']:.1f} s)",
                     "-" if every is None else f"{pruned['objective'] / every['objective']:.4f}"])
    for n in (512, 2048):
        full, stopped = fresh(solve_case, HIERARCHICAL, n), fresh(solve_case, HIERARCHICAL, n, max_iterations=2)
        rows.append([f"hierarchical, {n} jobs", "least normalised throughput", f"{full['objective']:.4f}",
                     f"{stopped['objective']:.4f} (stopped after 2 iterations)",
                     f"{full['objective'] / stopped['objective']:.4f}"])
    report.print_markdown(["problem", "objective (higher is better)", "megapipe", "compared with", "ratio"], rows)


def pop_table(sizes: list, partitions: list) -> None:
    rows = []
    for name in ("max_min_fairness_perf", "min_total_duration_perf", "finish_time_fairness_perf",
                 "max_min_fairness_packed"):
        for n in sizes:
            whole = None
            for k in partitions:
                result = fresh(solve_case, name, n, partitions=k)
                whole = whole or result
                gap = result["objective"] / whole["objective"] - 1
                gap = -gap if name in ("max_min_fairness_perf", "max_min_fairness_packed") else gap
                rows.append([f"`{name}`", n, k, f"{result['seconds']:.3f}", f"{result.get('warm', result['seconds']):.3f}",
                             f"{result['objective']:.6g}", f"{100 * gap:+.2f}%", f"{result['gib']:.2f}"])
    report.print_markdown(["policy", "jobs", "k", "first solve (s)", "re-solve (s)", "objective",
                           "worse than k = 1 by", "peak memory (GiB)"], rows)


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--jobs", default="32,128,512,2048")
    parser.add_argument("--packed-jobs", default="32,128,512,1024,2048")
    parser.add_argument("--pop-jobs", default="2048,10000")
    parser.add_argument("--pop-partitions", default="1,4,16")
    args = parser.parse_args()
    listed = lambda text: [int(s) for s in text.split(",") if s]  # noqa: E731
    print(f"{os.cpu_count()} CPUs\n")
    solve_times({"plain": listed(args.jobs), "packed": listed(args.packed_jobs)})
    print()
    objectives([n for n in listed(args.packed_jobs) if n >= 128])
    print()
    pop_table(listed(args.pop_jobs), listed(args.pop_partitions))
    print()
    rows = []
    for k in (1, 16):
        result = fresh(round_case, 2048, k)
        rows.append([2048, k, f"{result['seconds']:.3f}", f"{result['solve']:.3f}", f"{result['gib']:.2f}"])
    report.print_markdown(["active jobs", "k", "round after one arrival (s)", "of which solving (s)",
                           "peak memory (GiB)"], rows)


if __name__ == "__main__":
    main()
