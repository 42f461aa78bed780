"""Gavel: simulate heterogeneity-aware cluster scheduling policies on job traces, or generate traces.

Examples::

    python tools/cluster.py --list-policies
    python tools/cluster.py simulate --trace megapipe/cluster/data/max_min_fairness.trace \\
        --throughputs megapipe/cluster/data/simulation_throughputs.json \\
        --cluster v100:8,p100:16,k80:24 --policy max_min_fairness_perf
    python tools/cluster.py estimate --throughputs megapipe/cluster/data/simulation_throughputs.json
    python tools/cluster.py generate-trace --throughputs megapipe/cluster/data/simulation_throughputs.json \\
        --num-jobs 200 --jobs-per-hour 3 --multi-worker --output generated.trace

``simulate`` ends with ``average JCT: <hours> h`` over the steady-state window (``--window START END``,
job indices; by default the 25 jobs in the middle of the trace, or all of them when it has 25 or
fewer) and ``makespan: <hours> h``.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tqdm import tqdm  # noqa: E402

from megapipe.cluster.cluster_spec import parse_cluster  # noqa: E402
from megapipe.cluster.metrics import completion_times, summarise  # noqa: E402
from megapipe.cluster.policies import POLICY_NAMES, make_policy  # noqa: E402
from megapipe.cluster.policies.cost import check_slos  # noqa: E402
from megapipe.cluster.scheduler import Scheduler  # noqa: E402
from megapipe.cluster.simulator import simulate  # noqa: E402
from megapipe.cluster.throughputs import ThroughputTable  # noqa: E402
from megapipe.cluster.trace import generate_trace, read_trace, write_trace  # noqa: E402
from megapipe.errors import ConfigError  # noqa: E402

WINDOW_JOBS = 25


def default_window(num_jobs: int) -> tuple[int, int]:
    """The middle 25 jobs (Table 5.3 averages 25 steady-state jobs); every job of a short trace."""
    if num_jobs <= WINDOW_JOBS:
        return 0, num_jobs
    start = (num_jobs - WINDOW_JOBS) // 2
    return start, start + WINDOW_JOBS


def parse_prices(text: str | None) -> dict:
    if not text:
        return {}
    prices = {}
    for part in text.split(","):
        name, _, value = part.partition(":")
        try:
            prices[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--prices entry {part!r} is not TYPE:DOLLARS_PER_HOUR; write e.g. v100:2.48,p100:1.46,k80:0.45.")
    return prices


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list-policies", action="store_true", help="print the policy names and exit")
    commands = parser.add_subparsers(dest="command")
    run = commands.add_parser("simulate", help="simulate a policy on a trace")
    run.add_argument("--trace", required=True)
    run.add_argument("--throughputs", required=True)
    run.add_argument("--cluster", required=True, help="TYPE:COUNT,... e.g. v100:8,p100:16,k80:24")
    run.add_argument("--policy", required=True)
    run.add_argument("--round-seconds", type=float, default=360.0)
    run.add_argument("--reallocation-seconds", type=float, default=1920.0,
                     help="least time between allocation recomputations (the original simulator's 1920 s)")
    run.add_argument("--gpus-per-server", type=int, default=8)
    run.add_argument("--global-queue", action="store_true",
                     help="Algorithm 2 read literally: one priority order across accelerator types (default: type by type)")
    run.add_argument("--placement-sensitive", action="store_true",
                     help="policies also see unconsolidated throughputs of multi-worker jobs spread over servers")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--window", type=int, nargs=2, metavar=("START", "END"))
    run.add_argument("--prices", help="TYPE:$/h,... for cost and cost policies")
    run.add_argument("--estimate-throughputs", type=float, metavar="FRACTION",
                     help="policies see co-location throughputs estimated from profiling against FRACTION of the reference jobs")
    run.add_argument("--jcts-out", help="write {job id: JCT seconds} as JSON")
    run.add_argument("--plots-dir", help="write jct_cdf.png and utilisation.png here")
    est = commands.add_parser("estimate", help="error of the co-location throughput estimator (matrix completion)")
    est.add_argument("--throughputs", required=True)
    est.add_argument("--worker-type", default="v100")
    est.add_argument("--profiled-fractions", default="0.1,0.2,0.3,0.5")
    est.add_argument("--seed", type=int, default=0)
    gen = commands.add_parser("generate-trace", help="generate a trace with the chapter's process")
    gen.add_argument("--throughputs", required=True)
    gen.add_argument("--num-jobs", type=int, required=True)
    gen.add_argument("--jobs-per-hour", type=float, required=True, help="Poisson arrival rate; 0 puts every job at time 0")
    gen.add_argument("--multi-worker", action="store_true", help="worker counts 1 / 2-4 / 8 at 70 / 25 / 5%%")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--output", required=True)
    return parser


def run_simulation(args) -> None:
    if args.round_seconds <= 0:
        raise ConfigError(f"--round-seconds {args.round_seconds} must be positive.")
    policy = make_policy(args.policy, args.seed)
    policy.placement_sensitive = args.placement_sensitive
    table = ThroughputTable.load(args.throughputs)
    cluster = parse_cluster(args.cluster, args.gpus_per_server)
    unknown = [t for t in cluster.counts if t not in table.isolated]
    if unknown:
        raise ConfigError(f"--cluster type {unknown[0]} has no throughputs in {args.throughputs}; use one of {', '.join(table.worker_types)}.")
    jobs = read_trace(args.trace, table)
    check_slos(jobs, table, cluster)
    window = tuple(args.window) if args.window else default_window(len(jobs))
    if not 0 <= window[0] < window[1] <= len(jobs):
        raise ConfigError(f"--window {window[0]} {window[1]} must satisfy 0 <= START < END <= {len(jobs)} (jobs in the trace).")
    policy_table = None
    if args.estimate_throughputs is not None:
        if not 0 < args.estimate_throughputs <= 1:
            raise ConfigError(f"--estimate-throughputs {args.estimate_throughputs} must be a fraction in (0, 1].")
        from megapipe.cluster.estimator import estimated_table

        policy_table = estimated_table(table, args.estimate_throughputs, args.seed)
    scheduler = Scheduler(policy, table, cluster, args.round_seconds, args.reallocation_seconds, args.seed,
                          parse_prices(args.prices), args.global_queue, policy_table)
    with tqdm(total=len(jobs), unit="job", desc=args.policy, file=sys.stderr) as bar:
        simulate(scheduler, jobs, progress_bar=bar)
    summary = summarise(scheduler, window)
    jcts = completion_times(scheduler.records)
    if args.jcts_out:
        with open(args.jcts_out + ".tmp", "w") as handle:
            json.dump({str(k): v for k, v in sorted(jcts.items())}, handle, indent=1)
        os.replace(args.jcts_out + ".tmp", args.jcts_out)
    if args.plots_dir:
        from megapipe.cluster.plots import plot_jct_cdf, plot_utilisation

        os.makedirs(args.plots_dir, exist_ok=True)
        plot_jct_cdf({args.policy: list(jcts.values())}, os.path.join(args.plots_dir, "jct_cdf.png"))
        plot_utilisation(scheduler.utilisation, cluster.total, os.path.join(args.plots_dir, "utilisation.png"))
    print(f"jobs {window[0]}-{window[1] - 1} of {len(jobs)}; utilisation {summary.utilisation:.2f}; "
          f"average finish-time fairness {summary.average_ftf:.2f}")
    if scheduler.prices:
        print(f"cost: ${summary.total_cost:.2f}; SLO violations: {summary.slo_violations} of {summary.jobs_with_slo}")
    print(f"average JCT: {summary.average_jct_hours:.2f} h")
    print(f"makespan: {summary.makespan_hours:.2f} h")


def report_estimator(args) -> None:
    """Leave-one-out over the job types: mean relative error of the estimated co-location row."""
    from megapipe.cluster.estimator import estimate_error

    table = ThroughputTable.load(args.throughputs)
    if args.worker_type not in table.isolated:
        raise ConfigError(f"--worker-type {args.worker_type} is not in {args.throughputs}; use one of {', '.join(table.worker_types)}.")
    for fraction in (float(f) for f in args.profiled_fractions.split(",")):
        error = estimate_error(table, args.worker_type, fraction, args.seed)
        print(f"profiled against {fraction:.0%} of the reference jobs: mean relative error {error:.1%}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.list_policies:
            print("\n".join(POLICY_NAMES))
        elif args.command == "simulate":
            run_simulation(args)
        elif args.command == "estimate":
            report_estimator(args)
        elif args.command == "generate-trace":
            if args.num_jobs < 1:
                raise ConfigError(f"--num-jobs {args.num_jobs} must be at least 1.")
            table = ThroughputTable.load(args.throughputs)
            write_trace(generate_trace(table, args.num_jobs, args.jobs_per_hour, args.seed, args.multi_worker), args.output)
        else:
            parser.print_help()
            return 2
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
