"""Gavel: simulate scheduling policies on job traces, generate traces, or run the scheduler service and its workers.

Examples::

    python tools/cluster.py --list-policies
    python tools/cluster.py simulate --trace megapipe/cluster/data/max_min_fairness.trace \\
        --throughputs megapipe/cluster/data/simulation_throughputs.json \\
        --cluster v100:8,p100:16,k80:24 --policy max_min_fairness_perf
    python tools/cluster.py estimate --throughputs megapipe/cluster/data/simulation_throughputs.json
    python tools/cluster.py generate-trace --throughputs megapipe/cluster/data/simulation_throughputs.json \\
        --num-jobs 200 --jobs-per-hour 3 --multi-worker --output generated.trace

The scheduler service runs real megapipe jobs on worker agents::

    python tools/cluster.py serve --port 8470 --journal cluster.db --policy max_min_fairness_perf --round-seconds 30
    python tools/cluster.py worker --scheduler 127.0.0.1:8470 --secret-file cluster-work/secret \\
        --devices fast:2,slow:2 --host host-a --throttle slow:0.5
    python tools/cluster.py submit --scheduler 127.0.0.1:8470 --secret-file cluster-work/secret --name small -- \\
        pretrain_gpt.py --train-iters 200 --mock-data --vocab-size 128
    python tools/cluster.py status --scheduler 127.0.0.1:8470 --secret-file cluster-work/secret [--json | --page-url]
    python tools/cluster.py cancel --scheduler 127.0.0.1:8470 --secret-file cluster-work/secret 0

Every request is signed with the cluster's secret: ``--secret-file PATH`` (a file only its owner
may read) or the variable MEGAPIPE_CLUSTER_SECRET. ``serve`` on a loopback address without one
creates ``WORK_DIR/secret`` and prints where it is; on any other address it needs one. Jobs get
a key for their own lease only (MEGAPIPE_CLUSTER_LEASE_KEY); the status page opens with the
read-only token in the address ``serve`` and ``status --page-url`` print.

``serve`` and ``worker`` print one line per event: workers registered or lost, jobs submitted,
placed (a round's placements, when they change), started, stopped and ended, and a job no worker
type can hold, with why (``status`` shows that reason too). ``submit`` prints the job's id; when no
registered worker type can hold the job now, it also says so and why on stderr (the job waits in
the queue), or with ``--strict`` the scheduler refuses the job in one sentence (exit status 2).

``simulate`` ends with ``average JCT: <hours> h`` over the steady-state window (``--window START END``,
job indices; by default the 25 jobs in the middle of the trace, or all of them when it has 25 or
fewer) and ``makespan: <hours> h``; ``--jcts-out`` writes every job's JCT in the same hours.
"""

import argparse
import ipaddress
import json
import os
import signal
import socket
import ssl
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tqdm import tqdm  # noqa: E402

from megapipe.atomic_files import write_atomically  # noqa: E402
from megapipe.lease.auth import SECRET_ENV, configured_secret  # noqa: E402
from megapipe.cluster.core.cluster_spec import parse_cluster  # noqa: E402
from megapipe.cluster.sim.metrics import completion_times, summarise  # noqa: E402
from megapipe.cluster.core.policies import POLICY_NAMES, make_policy  # noqa: E402
from megapipe.cluster.core.policies.pop import check_partitions  # noqa: E402
from megapipe.cluster.core.policies.cost import check_slos  # noqa: E402
from megapipe.cluster.core.scheduler import Scheduler  # noqa: E402
from megapipe.cluster.sim.simulator import simulate  # noqa: E402
from megapipe.cluster.core.throughputs import ThroughputTable  # noqa: E402
from megapipe.cluster.sim.trace import generate_trace, read_trace, write_trace  # noqa: E402
from megapipe.errors import ConfigError, USAGE_ERROR, reports_user_errors  # noqa: E402

WINDOW_JOBS = 25
POP_HELP = ("solve the policy as K random parts of the jobs and of each accelerator type, in parallel processes "
            "(POP); parts whose jobs did not change are not solved again (default 1: the whole problem)")
SCHEDULER_HELP = "the scheduler's HOST:PORT, or the https://... address of a TLS proxy in front of it"


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
    run.add_argument("--pop-partitions", type=int, default=1, metavar="K", help=POP_HELP)
    run.add_argument("--window", type=int, nargs=2, metavar=("START", "END"))
    run.add_argument("--prices", help="TYPE:$/h,... for cost and cost policies")
    run.add_argument("--estimate-throughputs", type=float, metavar="FRACTION",
                     help="policies see co-location throughputs estimated from profiling against FRACTION of the reference jobs")
    run.add_argument("--jcts-out", help='write each finished job\'s JCT as JSON: {"units": "hours", "jct_hours": '
                                        '{job id: JCT}}, in the hours of the summary')
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
    _service_commands(commands)
    return parser


def _service_commands(commands) -> None:
    serve = commands.add_parser("serve", help="run the scheduler service (journal, rounds, leases, status page)")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--journal", required=True, help="SQLite file; a restarted service recovers its jobs from it")
    serve.add_argument("--policy", required=True)
    serve.add_argument("--round-seconds", type=float, required=True)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on and to give jobs for their leases")
    serve.add_argument("--work-dir", default=None, help="job logs and checkpoints (default: next to the journal)")
    serve.add_argument("--worker-types", default="fast,slow", help="accelerator types workers may declare")
    serve.add_argument("--no-lease-renewal", action="store_true",
                       help="end every lease with its round (each job saves and relaunches every round)")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--pop-partitions", type=int, default=1, metavar="K", help=POP_HELP)
    serve.add_argument("--backend", choices=("agents", "slurm"), default="agents",
                       help="run jobs through worker agents (tools/cluster.py worker) or as Slurm jobs on the "
                            "partition's nodes, typed by their GPU GRES")
    serve.add_argument("--slurm-partition", default=None, help="with --backend slurm: the partition (default Slurm's)")
    serve.add_argument("--slurm-conf", default=None, help="with --backend slurm: the slurm.conf (default Slurm's)")
    serve.add_argument("--secret-file", default=None, help=(
        f"the cluster's secret, a file only its owner may read (chmod 600); else ${SECRET_ENV}; with neither, "
        "serve on a loopback --host creates WORK_DIR/secret, and on any other address refuses to start"))
    serve.add_argument("--public-address", default=None, metavar="URL", help=(
        "where jobs reach the scheduler for their leases, e.g. https://sched.example.org behind a TLS proxy "
        "(default: http://HOST:PORT)"))
    serve.add_argument("--allowed-paths", nargs="+", metavar="DIR", default=None, help=(
        "the only directories a submitted job's path flags (--data-path, --vocab-file, --tensorboard-dir, ...) "
        "may name, symlinks resolved (default: WORK_DIR/files)"))
    worker = commands.add_parser("worker", help="run a worker agent for this host")
    worker.add_argument("--scheduler", required=True, metavar="HOST:P", help=SCHEDULER_HELP)
    _secret_flag(worker)
    worker.add_argument("--devices", required=True, metavar="TYPE:N[,TYPE:N]")
    worker.add_argument("--host", default=socket.gethostname(), help="this host's name (default: the hostname)")
    worker.add_argument("--address", default="127.0.0.1", help="address other hosts reach this one at")
    worker.add_argument("--throttle", default="", metavar="TYPE:FRACTION[,...]",
                        help="CPU fraction each device of a type gets (e.g. slow:0.5); default a whole CPU")
    submit = commands.add_parser("submit", help="submit a megapipe job; prints its id")
    submit.add_argument("--scheduler", required=True, metavar="HOST:P", help=SCHEDULER_HELP)
    _secret_flag(submit)
    submit.add_argument("--name", required=True)
    submit.add_argument("--priority", type=float, default=1.0)
    submit.add_argument("--strict", action="store_true", help=(
        "refuse the job (exit status 2, nothing queued) when no registered worker type can hold it now, "
        "instead of queueing it to wait for one"))
    submit.add_argument("job", nargs=argparse.REMAINDER, help="-- pretrain_gpt.py FLAGS...")
    status = commands.add_parser("status", help="jobs, their state, progress, allocation, JCT and log")
    status.add_argument("--scheduler", required=True, metavar="HOST:P", help=SCHEDULER_HELP)
    _secret_flag(status)
    status.add_argument("--json", action="store_true")
    status.add_argument("--page-url", action="store_true",
                        help="print the status page's address with its read-only token (for a browser) and exit")
    cancel = commands.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("--scheduler", required=True, metavar="HOST:P", help=SCHEDULER_HELP)
    _secret_flag(cancel)
    cancel.add_argument("id", type=int)


def _secret_flag(command) -> None:
    command.add_argument("--secret-file", default=None, help=(
        f"the scheduler's secret (the file serve uses, WORK_DIR/secret by default); else ${SECRET_ENV}"))


def client_secret(args) -> bytes:
    """The secret a worker or client signs its requests with; ConfigError when none is configured."""
    secret = configured_secret(args.secret_file)
    if secret is None:
        raise ConfigError(f"tools/cluster.py {args.command} needs the scheduler's secret; pass --secret-file PATH "
                          f"(serve prints where it is) or set {SECRET_ENV}.")
    return secret


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def say(line: str) -> None:
    """One line of what serve or worker does, at once (their output is often a log file)."""
    print(line, flush=True)


def run_service(args) -> None:
    from megapipe.lease.auth import create_secret_file, page_token
    from megapipe.cluster.service.http_api import serve
    from megapipe.cluster.service.journal import Journal
    from megapipe.cluster.service.service import ClusterService

    work_dir = args.work_dir or os.path.splitext(os.path.abspath(args.journal))[0] + "-work"
    secret = configured_secret(args.secret_file)  # first: what serve starts (sbatch too) must not inherit it
    backend = None
    if args.backend == "slurm":
        from megapipe.cluster.service.backends.slurm import SlurmBackend

        backend = SlurmBackend(args.slurm_partition, args.slurm_conf)
    elif args.slurm_partition or args.slurm_conf:
        raise ConfigError("--slurm-partition and --slurm-conf need --backend slurm; add it or drop them.")
    if secret is None:
        if not is_loopback(args.host):
            raise ConfigError(f"serve --host {args.host} is reachable from other machines, so it needs a secret; "
                              f"pass --secret-file PATH (a file only you can read) or set {SECRET_ENV}.")
        secret_file = os.path.join(work_dir, "secret")
        secret = create_secret_file(secret_file)
        say(f"the cluster's secret is in {secret_file}: pass --secret-file {secret_file} to worker, submit, status "
            "and cancel")
    service = ClusterService(Journal(args.journal), args.policy, args.round_seconds, work_dir,
                             tuple(t for t in args.worker_types.split(",") if t), not args.no_lease_renewal,
                             args.public_address or f"{args.host}:{args.port}", seed=args.seed, backend=backend,
                             pop_partitions=args.pop_partitions,
                             announce=say, secret=secret, allowed_paths=args.allowed_paths)
    server = serve(service, args.host, args.port, secret)
    say(f"scheduler listening on {args.host}:{server.server_address[1]} (journal {args.journal}, job logs and "
        f"checkpoints in {work_dir}; jobs may name paths in {', '.join(service.roots)}); status page: "
        f"http://{args.host}:{server.server_address[1]}/?token={page_token(secret)}")
    service.start()
    signal.signal(signal.SIGTERM, lambda *_: service.shutdown())
    while not service.stopping:
        time.sleep(0.5)
    server.shutdown()


def run_worker(args) -> None:
    from megapipe.cluster.worker.agent import WorkerAgent, parse_devices, parse_throttle

    devices = parse_devices(args.devices)
    agent = WorkerAgent(args.scheduler, args.host, args.address, devices, parse_throttle(args.throttle, devices),
                        announce=say, key=client_secret(args))
    agent.run()


def _call(args, path: str, body: dict | None = None) -> dict:
    """One signed request to the service at ``args.scheduler``; its refusal sentence becomes a ConfigError."""
    from megapipe.lease.client import get_json, post_json, scheduler_url

    scheduler, key = args.scheduler, client_secret(args)
    url = f"{scheduler_url(scheduler)}{path}"
    try:
        answer = get_json(url, 30, key) if body is None else post_json(url, body, 30, key)
    except OSError as error:
        if isinstance(getattr(error, "reason", error), ssl.SSLCertVerificationError):
            raise ConfigError(f"the certificate of --scheduler {scheduler} is not trusted "
                              f"({error.reason.verify_message}); give its proxy a certificate the system trusts, or set SSL_CERT_FILE to its CA.")
        raise ConfigError(f"no scheduler answers at --scheduler {scheduler} ({error}); start one with "
                          "tools/cluster.py serve.")
    if "error" in answer:
        raise ConfigError(answer["error"])
    return answer


def submit_job(args) -> None:
    """Submit the job and print its id; one line on stderr when no worker type can hold it now (it waits)."""
    command = args.job[1:] if args.job[:1] == ["--"] else args.job
    answer = _call(args, "/jobs", {"name": args.name, "priority": args.priority, "command": command,
                                   "strict": args.strict})
    print(answer["id"])
    if answer.get("unplaceable"):
        print(f"job {answer['id']} accepted but no registered worker type can hold it now, so it waits in the queue: "
              f"{answer['unplaceable']}", file=sys.stderr)


def print_status(args) -> None:
    if args.page_url:
        from megapipe.lease.auth import page_token
        from megapipe.lease.client import scheduler_url

        print(f"{scheduler_url(args.scheduler)}/?token={page_token(client_secret(args))}")
        return
    status = _call(args, "/status")
    print(json.dumps(status, indent=1) if args.json else status_table(status))


def status_table(status: dict) -> str:
    """The jobs, one line each, and under a queued job that no worker type can hold, why."""
    lines = [f"{'id':>3}  {'name':<12} {'state':<9} {'iterations':>11}  {'allocation':<28} {'JCT':>9}  log"]
    for job in status["jobs"]:
        slots = ",".join(f"{h}:{t}x{n}" for h, t, n in job["allocation"] or []) or "-"
        jct = "-" if job["jct"] is None else f"{job['jct']:.1f} s"
        lines.append(f"{job['id']:>3}  {job['name']:<12} {job['state']:<9} {job['iterations']:>5}/"
                     f"{job['target_iters']:<5}  {slots:<28} {jct:>9}  {job['log']}")
        if job["waiting"]:
            lines.append(f"{'':>5}cannot be placed: {job['waiting']}")
    return "\n".join(lines)


def run_simulation(args) -> None:
    if args.round_seconds <= 0:
        raise ConfigError(f"--round-seconds {args.round_seconds} must be positive.")
    policy = make_policy(args.policy, args.seed, args.pop_partitions)
    policy.placement_sensitive = args.placement_sensitive
    table = ThroughputTable.load(args.throughputs)
    cluster = parse_cluster(args.cluster, args.gpus_per_server)
    unknown = [t for t in cluster.counts if t not in table.isolated]
    if unknown:
        raise ConfigError(f"--cluster type {unknown[0]} has no throughputs in {args.throughputs}; use one of {', '.join(table.worker_types)}.")
    jobs = read_trace(args.trace, table)
    check_slos(jobs, table, cluster)
    check_partitions(args.pop_partitions, len(jobs), cluster.counts, policy)
    window = tuple(args.window) if args.window else default_window(len(jobs))
    if not 0 <= window[0] < window[1] <= len(jobs):
        raise ConfigError(f"--window {window[0]} {window[1]} must satisfy 0 <= START < END <= {len(jobs)} (jobs in the trace).")
    policy_table = None
    if args.estimate_throughputs is not None:
        if not 0 < args.estimate_throughputs <= 1:
            raise ConfigError(f"--estimate-throughputs {args.estimate_throughputs} must be a fraction in (0, 1].")
        from megapipe.cluster.core.estimator import estimated_table

        policy_table = estimated_table(table, args.estimate_throughputs, args.seed)
    scheduler = Scheduler(policy, table, cluster, args.round_seconds, args.reallocation_seconds, args.seed,
                          parse_prices(args.prices), args.global_queue, policy_table)
    with tqdm(total=len(jobs), unit="job", desc=args.policy, file=sys.stderr) as bar:
        simulate(scheduler, jobs, progress_bar=bar)
    summary = summarise(scheduler, window)
    jcts = completion_times(scheduler.records)
    if args.jcts_out:
        hours = {str(job): seconds / 3600 for job, seconds in sorted(jcts.items())}
        write_atomically(args.jcts_out, json.dumps({"units": "hours", "jct_hours": hours}, indent=1))
    if args.plots_dir:
        from megapipe.cluster.sim.plots import plot_jct_cdf, plot_utilisation

        os.makedirs(args.plots_dir, exist_ok=True)
        plot_jct_cdf({args.policy: list(jcts.values())}, os.path.join(args.plots_dir, "jct_cdf.png"))
        plot_utilisation(scheduler.utilisation, cluster.total, os.path.join(args.plots_dir, "utilisation.png"))
    print(f"jobs {window[0]}-{window[1] - 1} of {len(jobs)}; utilisation {summary.utilisation:.0%} of the "
          f"accelerator time; average finish-time fairness {summary.average_ftf:.2f} (JCT / JCT alone)")
    if scheduler.prices:
        print(f"cost: ${summary.total_cost:.2f}; SLO violations: {summary.slo_violations} of {summary.jobs_with_slo}")
    solves = scheduler.solve_seconds
    print(f"solve time per reallocation: mean {np.mean(solves):.3f} s, max {max(solves):.3f} s over {len(solves)}"
          + (f" ({policy.solves} part solves, the rest reused)" if args.pop_partitions > 1 else ""))
    print(f"average JCT: {summary.average_jct_hours:.2f} h")
    print(f"makespan: {summary.makespan_hours:.2f} h")


def report_estimator(args) -> None:
    """Leave-one-out over the job types: mean relative error of the estimated co-location row."""
    from megapipe.cluster.core.estimator import estimate_error

    table = ThroughputTable.load(args.throughputs)
    if args.worker_type not in table.isolated:
        raise ConfigError(f"--worker-type {args.worker_type} is not in {args.throughputs}; use one of {', '.join(table.worker_types)}.")
    for fraction in (float(f) for f in args.profiled_fractions.split(",")):
        error = estimate_error(table, args.worker_type, fraction, args.seed)
        print(f"profiled against {fraction:.0%} of the reference jobs: mean relative error {error:.1%}")


@reports_user_errors
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_policies:
        print("\n".join(POLICY_NAMES))
    elif args.command == "simulate":
        run_simulation(args)
    elif args.command == "estimate":
        report_estimator(args)
    elif args.command == "serve":
        run_service(args)
    elif args.command == "worker":
        run_worker(args)
    elif args.command == "submit":
        submit_job(args)
    elif args.command == "status":
        print_status(args)
    elif args.command == "cancel":
        _call(args, f"/jobs/{args.id}/cancel", {})
        print(f"job {args.id} cancelled")
    elif args.command == "generate-trace":
        if args.num_jobs < 1:
            raise ConfigError(f"--num-jobs {args.num_jobs} must be at least 1.")
        table = ThroughputTable.load(args.throughputs)
        jobs = generate_trace(table, args.num_jobs, args.jobs_per_hour, args.seed, args.multi_worker)
        write_trace(jobs, args.output)
        multi = sum(job.scale_factor > 1 for job in jobs)
        print(f"wrote {len(jobs)} jobs to {args.output}: arrivals over {jobs[-1].arrival_time / 3600:.1f} h, "
              f"{multi} of them on more than one worker")
    else:
        parser.print_help()
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
