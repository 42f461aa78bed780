"""Gavel on real megapipe jobs: a physical trace under two LAS policies, the simulator, preemption overhead.

    python benchmarks/bench_gavel_physical.py --round-seconds 20 --out benchmarks/results/gavel_physical_20s.json

Cluster: two hosts, each a network namespace of this machine (``megapipe/testing/hosts.py``; the
loopback address where namespaces cannot be made) with its worker agent (``host-a``, ``host-b``)
and 2 fast and 2 slow CPU devices (a rank per device, one thread each; slow devices throttled to
half a CPU); a two-device job placed on both hosts talks over the bridge between them.
Trace: 8 small GPT and BERT jobs of different lengths, priorities and sizes (1 or 2 devices),
all submitted at time 0. Three physical runs of the scheduler service, side by side:

1. heterogeneity-aware LAS (``max_min_fairness_perf``), lease renewals on;
2. heterogeneity-agnostic LAS (``max_min_fairness``), lease renewals on;
3. heterogeneity-aware LAS, lease renewals off (every job saves and relaunches every round).

Reported: how much slower the throttle makes a slow device (the same job on a fast and a slow
device at the same time, iterations/s); every job reaching its target; its per-iteration losses
against the job trained alone as submitted (bit for bit while it ran in the submitted layout, and
the largest relative difference over all iterations, re-laid-out ones included); the average JCT
of runs 1 and 2 and their ratio (seed 002 Table 5.3 reports 1.5x on its physical cluster); each
run's average JCT next to the part-1 simulator's on the same trace, cluster, policy and round
length (the chapter's simulator is within 8% of its cluster), fed what that run measured (each
job's iterations/s on each type from its log, under the run's own load), also with each job's
measured first start and last exit added (torch import, model build, final save and evaluation),
which the chapter's simulator leaves out; and the preemption overhead (seconds spent stopping,
saving, relaunching and loading over the JCT) per job with and without renewals, next to Table
5.4 (< 3% with 6-minute rounds). The jobs are 300-750 iterations, several 20 s rounds each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

from harness import cli, report
from megapipe.cluster.core.cluster_spec import ClusterSpec
from megapipe.cluster.service.job_log import continuity, iteration_losses, overlapping_runs, run_alone
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.service.local_cluster import LocalCluster, free_port
from megapipe.cluster.core.policies import make_policy
from megapipe.cluster.core.scheduler import Scheduler
from megapipe.cluster.sim.simulator import simulate
from megapipe.cluster.core.throughputs import ThroughputTable
from megapipe.testing.hosts import NamespacesUnavailable, TestHosts

ROOT = Path(__file__).resolve().parents[1]
HOSTS = {"host-a": "fast:2,slow:2", "host-b": "fast:2,slow:2"}
COMMON = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "4",
          "--global-batch-size", "16", "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1",
          "--hidden-dropout", "0", "--attention-dropout", "0"]
GPT = ["pretrain_gpt.py", "--num-layers", "4", "--mock-data", "--vocab-size", "256"] + COMMON
BERT = ["pretrain_bert.py", "--num-layers", "2"] + COMMON
TRACE = [  # name, priority, command
    ("gpt-a", 1.0, GPT + ["--train-iters", "450"]),
    ("gpt-b", 2.0, GPT + ["--train-iters", "750", "--seed", "2"]),
    ("gpt-t2", 1.0, GPT + ["--train-iters", "450", "--tensor-model-parallel-size", "2"]),
    ("gpt-p2", 1.0, GPT + ["--train-iters", "600", "--pipeline-model-parallel-size", "2"]),
    ("gpt-c", 1.0, GPT + ["--train-iters", "300", "--seed", "3"]),
    ("bert-a", 1.0, BERT + ["--train-iters", "450"]),
    ("bert-t2", 2.0, BERT + ["--train-iters", "300", "--tensor-model-parallel-size", "2"]),
    ("bert-b", 1.0, BERT + ["--train-iters", "600", "--seed", "2"]),
]
RUNS = [("max_min_fairness_perf", True), ("max_min_fairness", True), ("max_min_fairness_perf", False)]
TABLE_54 = {"ResNet-18": (0.94, 0.17), "ResNet-50": (1.58, 0.25), "A3C": (0.22, 0.0), "LSTM": (2.91, 0.47),
            "Transformer": (0.77, 0.11), "CycleGAN": (0.77, 0.11)}  # % overhead without / with renewals


def device_speeds(work_dir: str, throttle: float = 0.5) -> dict:
    """Iterations/s of one job on a fast and on a slow device at the same time (the throttle measured)."""
    command = GPT + ["--train-iters", "150"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    processes = {}
    for name in ("fast", "slow"):
        os.makedirs(os.path.join(work_dir, name), exist_ok=True)
        processes[name] = subprocess.Popen([sys.executable, str(ROOT / command[0]), *command[1:]],
                                           cwd=os.path.join(work_dir, name), env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    throttler = subprocess.Popen([sys.executable, "-m", "megapipe.cluster.worker.throttle", str(processes["slow"].pid),
                                  str(throttle)], env=env, cwd=str(ROOT))
    outputs = {name: process.communicate(timeout=1800)[0] for name, process in processes.items()}
    throttler.wait(timeout=60)
    speeds = {}
    for name, output in outputs.items():
        times = sorted(float(t) for t in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", output)[10:])
        speeds[name] = 1000 / times[len(times) // 2]  # median, after 10 warm-up iterations
    return speeds


def physical_run(policy: str, renew: bool, round_seconds: float, work_dir: str) -> dict:
    """One run of the trace on two test hosts (network namespaces), or on loopback hosts where none can be made."""
    try:
        hosts = TestHosts(len(HOSTS))
    except NamespacesUnavailable as reason:
        print(f"no test hosts ({reason}): the agents run on this machine's loopback address", file=sys.stderr)
        hosts = None
    try:
        return _trace(policy, renew, round_seconds, work_dir, hosts)
    finally:
        if hosts is not None:
            hosts.close()


def _trace(policy: str, renew: bool, round_seconds: float, work_dir: str, hosts) -> dict:
    flags = () if renew else ("--no-lease-renewal",)
    started = time.time()
    with LocalCluster(work_dir, policy, round_seconds, HOSTS, extra_serve_flags=flags, test_hosts=hosts) as cluster:
        ids = {name: cluster.submit(name, command, priority)["id"] for name, priority, command in TRACE}

        def finished() -> bool:
            jobs = [cluster.job(i) for i in ids.values()]
            failed = [j for j in jobs if j["state"] == "failed"]
            if failed:
                raise RuntimeError(f"job {failed[0]['name']} failed: {failed[0]['error']}")
            return all(j["state"] == "done" for j in jobs)

        cluster.wait_for(finished, 7200, "every job of the trace to finish")
        jobs = {name: cluster.job(job_id) for name, job_id in ids.items()}
    print(f"{policy} (renewals {'on' if renew else 'off'}): {time.time() - started:.0f} s", file=sys.stderr)
    return {"policy": policy, "renew": renew, "jobs": jobs, "namespaces": hosts is not None}


def measured_table(run: dict, runs: list[dict]) -> ThroughputTable:
    """Iterations/s of every job of ``run`` on each type, as its log measured them in that run (under
    that run's load); a type the run never placed a job on: its other type's rate times the mean
    slow/fast ratio of the run's jobs measured on both (of all runs' if none was)."""
    def ratio(among: list[dict]) -> list[float]:
        return [j["throughput"]["slow"] / j["throughput"]["fast"] for r in among for j in r["jobs"].values()
                if {"fast", "slow"} <= set(j["throughput"])]

    ratios = ratio([run]) or ratio(runs)
    slow_over_fast = sum(ratios) / len(ratios)
    table = ThroughputTable()
    for name, job in run["jobs"].items():
        rate = job["throughput"]
        fast = rate.get("fast", rate.get("slow", 0.0) / slow_over_fast)
        table.add_job_type(name, job["devices"], {"fast": fast, "slow": rate.get("slow", fast * slow_over_fast)})
    return table


def simulated_jct(policy: str, table: ThroughputTable, round_seconds: float) -> float:
    """Average JCT of the part-1 simulator on the trace, this cluster and round length, ``table``'s throughputs."""
    jobs = [Job(i, name, int(command[command.index("--train-iters") + 1]), _devices(command), priority)
            for i, (name, priority, command) in enumerate(TRACE)]
    counts = {"fast": 4, "slow": 4}
    scheduler = Scheduler(make_policy(policy), table, ClusterSpec(counts, 2), round_seconds, reallocation_seconds=0.0)
    simulate(scheduler, jobs)
    return sum(record.finish_time - record.job.arrival_time for record in scheduler.records.values()) / len(jobs)


def _devices(command: list[str]) -> int:
    size = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        if flag in command:
            size *= int(command[command.index(flag) + 1])
    return size


def losses_alone(work_dir: str) -> dict:
    """Each job trained alone, uninterrupted, as submitted (two at a time)."""
    def one(entry):
        name, _, command = entry
        return name, iteration_losses(run_alone(command, _devices(command), os.path.join(work_dir, name),
                                                free_port(), timeout=1800))
    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, TRACE))


def summarise(runs: list[dict], references: dict, round_seconds: float) -> dict:
    summary = {"round_seconds": round_seconds, "runs": []}
    for run in runs:
        jobs, table = run["jobs"], measured_table(run, runs)
        jct = sum(j["jct"] for j in jobs.values()) / len(jobs)
        checks = {name: continuity(open(j["log"]).read(), references[name], command, j["devices"])
                  for name, (_, _, command) in zip(jobs, TRACE) for j in [jobs[name]]}
        summary["runs"].append({
            "policy": run["policy"], "renew": run["renew"], "average_jct": jct,
            "simulated_jct": simulated_jct(run["policy"], table, round_seconds),
            "fixed_seconds": sum(j["fixed_seconds"] for j in jobs.values()) / len(jobs),
            "costs": {name: j["costs"] for name, j in jobs.items()},
            "namespaces": run.get("namespaces", False),
            "all_done": all(j["iterations"] == j["target_iters"] for j in jobs.values()),
            "never_twice": all(not overlapping_runs(open(j["log"]).read()) for j in jobs.values()),
            "losses": checks,
            "overhead": {name: j["overhead_seconds"] / j["jct"] for name, j in jobs.items()},
            "leases": {name: j["leases"] for name, j in jobs.items()},
            "throughput": {name: j["throughput"] for name, j in jobs.items()},
            "jct": {name: j["jct"] for name, j in jobs.items()}})
    return summary


def print_summary(summary: dict) -> None:
    runs = summary["runs"]
    aware, agnostic = runs[0], runs[1]
    speeds = summary["device_speeds"]
    print(f"round {summary['round_seconds']:g} s; 2 hosts x (2 fast + 2 slow); {len(TRACE)} jobs; one job alone on a "
          f"fast device {speeds['fast']:.1f} it/s, on a slow one {speeds['slow']:.1f} it/s at the same time "
          f"({speeds['fast'] / speeds['slow']:.2f}x)")
    print("\n".join(report.markdown(
        ["policy", "lease renewals", "average JCT (s)", "simulated (s)", "physical / simulated",
         "simulated + first start and last exit (s)", "physical / that", "every job done",
         "jobs bit for bit throughout", "max relative loss difference", "mean preemption overhead"])))
    for run in runs:
        checks = run["losses"].values()
        exact = sum(c["bit_exact_throughout"] and c["complete"] for c in checks)
        overhead = sum(run["overhead"].values()) / len(run["overhead"])
        print(f"| {run['policy']} | {'on' if run['renew'] else 'off'} | {run['average_jct']:.1f} | "
              f"{run['simulated_jct']:.1f} | {run['average_jct'] / run['simulated_jct']:.3f} | "
              f"{run['simulated_jct'] + run['fixed_seconds']:.1f} | "
              f"{run['average_jct'] / (run['simulated_jct'] + run['fixed_seconds']):.3f} | "
              f"{run['all_done']} | {exact}/{len(checks)} | {max(c['max_relative'] for c in checks):.1e} | "
              f"{100 * overhead:.1f}% |")
    print(f"heterogeneity-agnostic / aware average JCT: {agnostic['average_jct'] / aware['average_jct']:.2f}x "
          "(seed 002 Table 5.3, physical: 1.5x)")
    print("\n".join(report.markdown(["job", "overhead without renewals", "with renewals"])))
    for name in runs[0]["overhead"]:
        print(f"| {name} | {100 * runs[2]['overhead'][name]:.1f}% | {100 * runs[0]['overhead'][name]:.1f}% |")
    for model, (without, with_) in TABLE_54.items():
        print(f"| {model} (Table 5.4, 6-minute rounds) | {without:.2f}% | {with_:.2f}% |")


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--round-seconds", type=float, default=20.0)
    parser.add_argument("--out", default="benchmarks/results/gavel_physical_20s.json")
    parser.add_argument("--work-dir", default=None,
                        help="logs, journals and checkpoints (default: a temporary one); when it holds runs.json from "
                             "an earlier invocation, only the references and the summary are redone")
    args = parser.parse_args()
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="gavel-physical-")
    saved = os.path.join(work_dir, "runs.json")
    if os.path.exists(saved):  # the physical runs of an earlier invocation with this --work-dir
        runs = json.load(open(saved))
    else:
        runs = [physical_run(policy, renew, args.round_seconds, os.path.join(work_dir, f"{policy}-{renew}"))
                for policy, renew in RUNS]
        with open(saved, "w") as handle:
            json.dump(runs, handle)
    summary = summarise(runs, losses_alone(os.path.join(work_dir, "alone")), args.round_seconds)
    summary["device_speeds"] = device_speeds(os.path.join(work_dir, "speeds"))
    report.write_json(args.out, summary)
    print_summary(summary)


if __name__ == "__main__":
    main()
