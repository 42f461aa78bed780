"""The scheduler service on Slurm (``serve --backend slurm``): the same kind of small trace, end to end.

A real Slurm (``slurm_testbed.py``: slurmctld and two slurmd nodes, each with 2 "fast" and 2
"slow" typed GPU GRES) and the service with heterogeneity-aware LAS, 15 s rounds and no lease
renewals, so that a job still running at the end of a round is preempted: Slurm signals its tasks
(SIGTERM), the training loop saves and exits, and the next round's allocation is a new Slurm job
that resumes from the checkpoint (renewals do not depend on the backend; test_cluster_service.py
covers them). Two small GPT jobs (one device, and two devices submitted with tensor size 2) run
to their targets. Every job's losses are compared with it trained alone as submitted: bit for bit while
it ran in the submitted layout, within 1e-5 relative everywhere (a re-layout sums the same numbers
in another order; dropout is off). No job runs twice at once.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from launch_helpers import forked_run
from megapipe.cluster.service.backends.slurm_testbed import SlurmTestbed, SlurmUnavailable, unavailable_reason
from megapipe.cluster.service.job_log import continuity, iteration_losses, overlapping_runs, run_alone
from megapipe.cluster.service.local_cluster import LocalCluster, free_port

pytestmark = [pytest.mark.system, pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
              pytest.mark.timeout(900)]

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256",
         "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
JOBS = {"one": ["pretrain_gpt.py"] + MODEL + ["--train-iters", "400"],
        "two": ["pretrain_gpt.py"] + MODEL + ["--train-iters", "150", "--tensor-model-parallel-size", "2"]}
# "two" is the shorter: its reference, as submitted, is tensor-parallel over gloo (about five times the CPU of an
# iteration of the data-parallel layout the scheduler runs it in); "one" spans rounds, so a job is preempted
NODES = {"node1": {"fast": 2, "slow": 2}, "node2": {"fast": 2, "slow": 2}}


def test_a_small_trace_runs_end_to_end_on_slurm(tmp_path):
    try:
        with SlurmTestbed(str(tmp_path / "slurm"), NODES) as slurm:
            flags = ("--backend", "slurm", "--slurm-partition", slurm.partition, "--slurm-conf", slurm.conf,
                     "--no-lease-renewal")
            with LocalCluster(str(tmp_path / "cluster"), "max_min_fairness_perf", 15, {},
                              extra_serve_flags=flags) as cluster:
                cluster.wait_for(lambda: cluster.status()["workers_by_type"] == {"fast": 4, "slow": 4}, 120,
                                 "the Slurm nodes to appear as workers")
                ids = {name: cluster.submit(name, command)["id"] for name, command in JOBS.items()}

                def finished() -> bool:
                    jobs = [cluster.job(i) for i in ids.values()]
                    assert not [j for j in jobs if j["state"] == "failed"], jobs
                    return all(j["state"] == "done" for j in jobs)

                cluster.wait_for(finished, 600, "every job to finish on Slurm")
                jobs = {name: cluster.job(job_id) for name, job_id in ids.items()}
    except SlurmUnavailable as error:
        pytest.skip(str(error))
    with ThreadPoolExecutor(len(jobs)) as pool:  # each job trained alone, uninterrupted, as submitted
        references = dict(zip(jobs, pool.map(
            lambda name: iteration_losses(run_alone(JOBS[name], jobs[name]["devices"], str(tmp_path / name),
                                                    free_port(), run=forked_run)), jobs)))
    for name, job in jobs.items():
        log = open(job["log"]).read()
        assert overlapping_runs(log) == [], f"job {name} ran twice at once"
        found = continuity(log, references[name], JOBS[name], job["devices"])
        assert found["complete"] and found["bit_exact_before"] and found["max_relative"] <= 1e-5, (name, found)
    assert sum(job["leases"] for job in jobs.values()) > len(jobs), "no job was ever preempted"
