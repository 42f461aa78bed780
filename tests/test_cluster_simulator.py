"""The simulator, traces, estimator and tools/cluster.py (bad input refused in one sentence)."""

import json

import numpy as np
import pytest

from megapipe.cluster.core.cluster_spec import ClusterSpec, parse_cluster
from megapipe.cluster.core.estimator import complete, estimate_error
from megapipe.cluster.core.jobs import Job as Job_
from megapipe.cluster.sim.metrics import completion_times, summarise
from megapipe.cluster.core.policies import make_policy
from megapipe.cluster.core.scheduler import Scheduler
from megapipe.cluster.sim.simulator import simulate
from megapipe.cluster.core.throughputs import ThroughputTable
from megapipe.cluster.sim.trace import format_job, generate_trace, read_trace, write_trace
from cluster_helpers import DATA, load_cluster_tool, small_jobs, small_table

pytestmark = pytest.mark.unit

cli = load_cluster_tool()


@pytest.fixture(scope="module")
def table():
    return ThroughputTable.load(DATA + "simulation_throughputs.json")


@pytest.mark.parametrize("policy", ["max_min_fairness_perf", "fifo", "gandiva", "min_total_duration_perf"])
def test_every_job_finishes_no_faster_than_alone(policy):
    """Each job's JCT is at least its steps at its fastest type's throughput; all steps are run."""
    table = small_table()
    jobs = small_jobs()
    for job in jobs:
        job.slo = None
    scheduler = Scheduler(make_policy(policy), table, ClusterSpec({"v100": 1, "p100": 2, "k80": 2}), 60.0, 120.0)
    simulate(scheduler, jobs)
    jct = completion_times(scheduler.records)
    assert sorted(jct) == [job.job_id for job in jobs]
    for job in jobs:
        fastest = max(table.alone(job.job_type, job.scale_factor, t) for t in ("v100", "p100", "k80"))
        assert jct[job.job_id] >= job.total_steps / fastest - 1e-6
        assert scheduler.records[job.job_id].steps_done == job.total_steps


def test_heterogeneity_aware_las_beats_las_on_a_small_trace(table):
    results = {}
    for policy in ("max_min_fairness", "max_min_fairness_perf"):
        scheduler = Scheduler(make_policy(policy), table, parse_cluster("v100:2,p100:2,k80:2"))
        simulate(scheduler, read_trace(DATA + "small_test.trace", table))
        results[policy] = summarise(scheduler).average_jct_hours
    assert results["max_min_fairness_perf"] < results["max_min_fairness"]


def test_trace_round_trip_and_generator(table, tmp_path):
    jobs = generate_trace(table, 400, jobs_per_hour=4, seed=2, multi_worker=True)
    write_trace(jobs, tmp_path / "g.trace")
    again = read_trace(tmp_path / "g.trace", table)
    assert [format_job(j) for j in again] == [format_job(j) for j in jobs]
    scales = np.array([j.scale_factor for j in jobs])
    assert abs((scales == 1).mean() - 0.70) < 0.07 and abs((scales == 8).mean() - 0.05) < 0.04
    gaps = np.diff([j.arrival_time for j in jobs])
    assert abs(gaps.mean() - 900) < 150  # 4 jobs/h: exponential gaps of mean 900 s


def test_matrix_completion_recovers_a_low_rank_matrix():
    rng = np.random.default_rng(0)
    truth = rng.random((20, 2)) @ rng.random((2, 20))
    known = rng.random(truth.shape) < 0.6
    filled = complete(np.where(known, truth, 0.0), known, rank=2, iterations=500)
    assert np.abs(filled - truth).max() < 1e-3


def test_estimator_error_falls_with_more_profiling(table):
    assert estimate_error(table, profiled_fraction=0.5) < estimate_error(table, profiled_fraction=0.1)


def run_cli(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def simulate_args(trace, cluster="v100:2,p100:2,k80:2", policy="max_min_fairness_perf"):
    return ["simulate", "--trace", str(trace), "--throughputs", DATA + "simulation_throughputs.json",
            "--cluster", cluster, "--policy", policy]


def test_cli_simulate_prints_the_contract_lines(capsys, tmp_path):
    code, out, _ = run_cli(simulate_args(DATA + "small_test.trace") + ["--jcts-out", str(tmp_path / "j.json")], capsys)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[-2].startswith("average JCT: ") and lines[-2].endswith(" h")
    assert lines[-1].startswith("makespan: ") and lines[-1].endswith(" h")
    written = json.loads((tmp_path / "j.json").read_text())
    assert written["units"] == "hours" and len(written["jct_hours"]) == 20  # the whole trace is the window
    assert float(lines[-2].split()[2]) == pytest.approx(np.mean(list(written["jct_hours"].values())), abs=0.005)
    assert lines[-3].startswith("solve time per reallocation: mean ")


def test_cli_simulate_with_pop_reuses_unchanged_parts(capsys):
    """POP on the Table 5.3 continuous trace: JCT within 2% of the whole solve (as docs/cluster.md reports),
    and fewer part solves than parts times reallocations."""
    args = simulate_args(DATA + "max_min_fairness.trace", "v100:8,p100:16,k80:24")
    results = []
    for extra in ([], ["--pop-partitions", "4"]):
        code, out, _ = run_cli(args + extra, capsys)
        assert code == 0
        results.append(out.strip().splitlines())
    whole, pop = (float(lines[-2].split()[2]) for lines in results)
    assert pop == pytest.approx(whole, rel=0.02)
    solves = results[1][-3]
    reallocations = int(solves.split(" over ")[1].split()[0])
    assert int(solves.split("(")[1].split()[0]) < 4 * reallocations


def test_cli_generate_trace_says_what_it_wrote(capsys, tmp_path, table):
    path = tmp_path / "g.trace"
    code, out, _ = run_cli(["generate-trace", "--throughputs", DATA + "simulation_throughputs.json", "--num-jobs", "30",
                            "--jobs-per-hour", "4", "--multi-worker", "--seed", "3", "--output", str(path)], capsys)
    jobs = read_trace(path, table)
    assert code == 0 and len(jobs) == 30
    assert out == (f"wrote 30 jobs to {path}: arrivals over {jobs[-1].arrival_time / 3600:.1f} h, "
                   f"{sum(j.scale_factor > 1 for j in jobs)} of them on more than one worker\n")


def bad_trace(tmp_path, mutate):
    lines = open(DATA + "small_test.trace").read().splitlines()
    lines[2] = mutate(lines[2].split("\t"))
    path = tmp_path / "bad.trace"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("case, needle", [
    ("missing field", "line 3 has 9 tab-separated fields"),
    ("unknown type", "line 3: job type 'NoSuchNet'"),
    ("negative count", "negative count"),
    ("unknown policy", "--policy nope is unknown"),
    ("infeasible slo", "cannot meet its SLO"),
    ("pop partitions", "--pop-partitions 3 exceeds the 2 v100 workers"),
    ("pop policy", "--pop-partitions cannot split policy gandiva"),
])
def test_cli_refuses_bad_input_in_one_sentence(case, needle, capsys, tmp_path):
    trace, cluster, policy = DATA + "small_test.trace", "v100:2,p100:2,k80:2", "max_min_fairness_perf"
    extra = []
    if case == "missing field":
        trace = bad_trace(tmp_path, lambda f: "\t".join(f[:9]))
    elif case == "unknown type":
        trace = bad_trace(tmp_path, lambda f: "\t".join(["NoSuchNet"] + f[1:]))
    elif case == "negative count":
        cluster = "v100:-2,k80:2"
    elif case == "unknown policy":
        policy = "nope"
    elif case.startswith("pop"):
        extra = ["--pop-partitions", "3"] if case == "pop partitions" else ["--pop-partitions", "2"]
        policy = "gandiva" if case == "pop policy" else policy
    else:
        trace = bad_trace(tmp_path, lambda f: "\t".join(f[:8] + ["1.0"] + f[9:]))
    code, out, err = run_cli(simulate_args(trace, cluster, policy) + extra, capsys)
    assert code == 2 and out == ""
    assert needle in err and err.count("\n") == 1


def test_list_policies(capsys):
    code, out, _ = run_cli(["--list-policies"], capsys)
    assert code == 0 and "max_sum_throughput_normalized_by_cost_perf_SLOs" in out.split()


def test_megapipe_job_gets_a_row_from_the_planner():
    """A megapipe GPT's predicted steps/s on two accelerator kinds becomes a schedulable row of T."""
    from megapipe.cluster.core.throughputs import planner_steps_per_second
    from megapipe.planner.analytic import analytic_gpt_profile
    from megapipe.planner.cluster import Cluster
    from megapipe.planner.plan import PlanRequest, plan
    from megapipe.planner.profile import ModelShape

    profile = analytic_gpt_profile(ModelShape("gpt", 8, 64, 4, 32, 128, 256), 1e12, micro_batch_sizes=(1, 2, 4))
    machines = {kind: Cluster(nodes=1, gpus_per_node=2, memory_per_gpu=64 * 2 ** 30, intra_node_bandwidth=5e10,
                              inter_node_bandwidth=5e9, compute_speed=speed)
                for kind, speed in (("fast", 1.0), ("slow", 0.25))}
    request = PlanRequest(16, max_micro_batch_size=4)
    rates = planner_steps_per_second(profile, machines, request)
    assert rates["fast"] == pytest.approx(plan(profile, machines["fast"], request).best.samples_per_second / 16)
    assert rates["fast"] > rates["slow"] > 0
    table = ThroughputTable()
    table.add_job_type("megapipe-gpt", 2, rates)
    jobs = [Job_(0, "megapipe-gpt", 1000, 2)]
    scheduler = Scheduler(make_policy("max_min_fairness_perf"), table, ClusterSpec({"fast": 2, "slow": 2}), 60.0)
    simulate(scheduler, jobs)
    assert completion_times(scheduler.records)[0] >= 1000 / rates["fast"]


def test_estimated_table_and_learning_measured_pairs(table):
    """Fully profiled, the estimates are the truth; partly profiled, pairs that run are learned exactly."""
    from megapipe.cluster.core.estimator import estimated_table

    full = estimated_table(table, 1.0)
    assert full.pairs["v100"] == table.pairs["v100"]
    estimates = estimated_table(table, 0.2, seed=1)
    before = {w: dict(pairs) for w, pairs in estimates.pairs.items()}
    assert estimates.pairs["v100"] != table.pairs["v100"]
    scheduler = Scheduler(make_policy("max_min_fairness_packed"), table, parse_cluster("v100:2,p100:2,k80:2"),
                          policy_table=estimates)
    simulate(scheduler, read_trace(DATA + "small_test.trace", table))
    assert len(completion_times(scheduler.records)) == 20
    ran = [(w, k) for w, pairs in scheduler.policy_table.pairs.items() for k in pairs
           if pairs[k] != before[w].get(k)]
    assert ran, "no co-located pair ran"
    for worker_type, key in ran:
        truth = table.colocated(key[0], key[1], worker_type)
        assert scheduler.policy_table.pairs[worker_type][key] == pytest.approx(truth, rel=0.02)
