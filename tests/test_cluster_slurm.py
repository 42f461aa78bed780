"""The Slurm backend against a real Slurm: slurmctld and three slurmd nodes with 2 "fast" and 2 "slow"
typed GPU GRES each (``slurm_testbed.py``), started once for the module.

A tiny GPT (2 nodes x 1 rank, data parallel 2) runs to completion as one Slurm job; the same job
stopped by ``stop()`` saves a checkpoint on SIGTERM and exits 0, and its next allocation (other
nodes, other accelerator types: a heterogeneous Slurm job) resumes from it and logs, iteration for
iteration, the uninterrupted run's losses to all 7 printed digits (the checkpoint holds the random
states and the data position; the layout is the same, so the sums are the same). A job that
ignores SIGTERM is killed once the grace period is over. Refusals (an unknown node, a drained
node, a GRES type or count the node lacks) are one sentence each, and a pending job whose node is
drained ends with that sentence in its log.
"""

import os
import re
import time

import pytest

from megapipe.cluster.service.backends.base import HostSlots, Launch
from megapipe.cluster.service.backends.slurm import SlurmBackend
from megapipe.cluster.service.backends.slurm_testbed import SlurmTestbed, SlurmUnavailable, unavailable_reason
from megapipe.errors import SlurmError
from test_training_cli import ROOT, TINY, losses

pytestmark = [pytest.mark.system, pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

NODES = {"node1": {"fast": 2, "slow": 2}, "node2": {"fast": 2, "slow": 2}, "node3": {"fast": 2, "slow": 2}}
ITERATIONS = 150  # a stop after iteration 3 lands by iteration 25 here, under load (SIGTERM takes a few)
RUN_SECONDS = 240


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        # as deep as a pytest-xdist worker's folders and more: a Unix socket's path under it would pass 107
        # bytes, so a job step starts only because the testbed keeps its sockets elsewhere
        deep = tmp_path_factory.mktemp("slurm-testbed-in-a-folder-deeper-than-a-unix-socket-path-may-be")
        with SlurmTestbed(str(deep), NODES) as testbed:
            yield testbed
    except SlurmUnavailable as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def backend(slurm):
    return SlurmBackend(partition=slurm.partition, slurm_conf=slurm.conf, workdir=ROOT)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data-cache"))


def launch(job_id: int, hosts, directory, cache: str) -> Launch:
    command = ["pretrain_gpt.py", *TINY, "--train-iters", str(ITERATIONS),
               "--save", str(directory / "ckpt"), "--load", str(directory / "ckpt"), "--save-interval", "1000"]
    return Launch(job_id, command, tuple(hosts), {"MEGAPIPE_CACHE": cache, "OMP_NUM_THREADS": "1"},
                  str(directory / "job 1%.log"))  # a space and a % survive sbatch --output


def wait(backend: SlurmBackend, job_id: int) -> int:
    deadline = time.monotonic() + RUN_SECONDS
    while (code := backend.poll(job_id)) is None:
        assert time.monotonic() < deadline, f"job {job_id} still runs after {RUN_SECONDS} s"
        time.sleep(0.5)
    return code


def wait_for_line(path: str, pattern: str) -> None:
    deadline = time.monotonic() + RUN_SECONDS
    while not (os.path.exists(path) and re.search(pattern, open(path).read(), re.M)):
        assert time.monotonic() < deadline, f"no line matching {pattern!r} in {path} within {RUN_SECONDS} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def uninterrupted(backend, cache, tmp_path_factory):
    """The reference: the job run to its end in one allocation (node1 and node2, one fast device each)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    job = launch(1, [HostSlots("node1", "fast", 1), HostSlots("node2", "fast", 1)], directory, cache)
    backend.start(job)
    return wait(backend, 1), open(job.log_path).read()


def test_a_job_runs_to_completion_as_one_slurm_job(uninterrupted):
    code, log = uninterrupted
    assert code == 0, log[-3000:]
    assert re.search(r"runs job 1 on node1 \(fast x1\), node2 \(fast x1\)", log)
    assert "data 0/2" in log  # one rank on each node: data parallel 2
    assert sorted(losses(log)) == list(range(1, ITERATIONS + 1)), log[-3000:]


def test_a_stopped_job_saves_and_its_next_allocation_resumes_with_the_same_losses(backend, cache, tmp_path,
                                                                                  uninterrupted):
    job = launch(2, [HostSlots("node1", "fast", 1), HostSlots("node2", "fast", 1)], tmp_path, cache)
    backend.start(job)
    wait_for_line(job.log_path, r"^ iteration\s+3/")
    backend.stop(2, grace_seconds=120)
    assert wait(backend, 2) == 0, open(job.log_path).read()[-3000:]  # saved and exited cleanly
    first = open(job.log_path).read()
    stopped_at = int(re.search(r"exiting on SIGTERM at iteration (\d+)", first)[1])
    assert 3 <= stopped_at < ITERATIONS
    saved = (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
    assert int(saved) == stopped_at

    # the next allocation: other nodes and types, one per host (a heterogeneous Slurm job)
    backend.start(launch(2, [HostSlots("node2", "slow", 1), HostSlots("node1", "fast", 1)], tmp_path, cache))
    assert wait(backend, 2) == 0, open(job.log_path).read()[-3000:]
    log = open(job.log_path).read()  # both allocations appended to the one log
    assert log.startswith(first) and re.search(rf"loaded checkpoint .*iter_{stopped_at:07d}", log)
    assert "runs job 2 on node2 (slow x1), node1 (fast x1)" in log
    resumed = losses(log[len(first):])
    assert sorted(resumed) == list(range(stopped_at + 1, ITERATIONS + 1))
    reference = losses(uninterrupted[1])
    assert resumed == {i: reference[i] for i in resumed}
    assert losses(first) == {i: reference[i] for i in range(1, stopped_at + 1)}


def test_stop_of_a_finished_job_returns_its_code(backend, uninterrupted):
    backend.stop(1, grace_seconds=0)
    assert backend.poll(1) == 0


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace_period(backend, tmp_path):
    script = tmp_path / "ignores_sigterm.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "print('ignoring SIGTERM', flush=True)\ntime.sleep(600)\n")
    # two components: node1 and node2 with one device each, node3 with two (node ranks 0, 1 and 2)
    hosts = (HostSlots("node1", "slow", 1), HostSlots("node2", "slow", 1), HostSlots("node3", "slow", 2))
    job = Launch(6, [str(script)], hosts, {}, str(tmp_path / "job.log"))
    backend.start(job)
    wait_for_line(job.log_path, "^ignoring SIGTERM")
    stopped = time.monotonic()
    backend.stop(6, grace_seconds=2)
    code = wait(backend, 6)
    assert code > 128 and time.monotonic() - stopped >= 2, (code, open(job.log_path).read())  # ended by a signal
    assert open(job.log_path).read().count("ignoring SIGTERM") == 4  # every rank started, and now gone
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and _runs(pid, str(script))]


def _runs(pid: str, script: str) -> bool:
    try:
        return script.encode() in open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:  # ended meanwhile
        return False


def test_a_new_backend_adopts_and_stops_the_jobs_an_earlier_one_started(slurm, backend, tmp_path):
    """As after a scheduler restart: the running job is found by its Slurm job name, not started twice."""
    script = tmp_path / "runs_until_sigterm.py"
    script.write_text("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
                      "print('running', flush=True)\ntime.sleep(600)\n")
    job = Launch(7, [str(script)], (HostSlots("node2", "fast", 1),), {}, str(tmp_path / "job.log"))
    backend.start(job)
    wait_for_line(job.log_path, "^running")
    again = SlurmBackend(partition=slurm.partition, slurm_conf=slurm.conf, workdir=ROOT)
    assert 7 in again.running_job_ids() and again.poll(7) is None
    with pytest.raises(SlurmError, match=r"^job 7 still runs as Slurm job \d+; stop it and wait until poll"):
        again.start(job)
    again.stop(7, grace_seconds=120)
    assert wait(again, 7) == 0 and 7 not in again.running_job_ids()
    with pytest.raises(SlurmError, match="^job 8 has no Slurm job named megapipe-8 pending or running; start it"):
        again.poll(8)


def test_the_nodes_and_their_accelerators_come_from_slurm(backend):
    assert backend.nodes() == NODES


@pytest.mark.parametrize("hosts, message", [
    ([HostSlots("node9", "fast", 1)], "Slurm has no node named node9 (job 3); declare the host by its Slurm node"),
    ([HostSlots("node1", "v100", 1)], "Slurm refused job 3 on node1 (v100 x1): Batch job submission failed: "
                                      "Requested node configuration is not available"),
    ([HostSlots("node1", "fast", 3)], "Slurm refused job 3 on node1 (fast x3): Batch job submission failed"),
])
def test_a_placement_slurm_cannot_run_is_refused_in_one_sentence(backend, cache, tmp_path, hosts, message):
    with pytest.raises(SlurmError) as error:
        backend.start(launch(3, hosts, tmp_path, cache))
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_a_drained_node_is_refused_and_one_drained_under_a_pending_job_fails_it(slurm, backend, cache, tmp_path):
    drain = ["scontrol", "update", "nodename=node2", "state=drain", "reason=maintenance"]
    slurm.run(drain)
    try:
        with pytest.raises(SlurmError, match=r"^Slurm node node2 is drained and cannot run job 4; resume it "
                                             r"\(scontrol update nodename=node2 state=resume\)"):
            backend.start(launch(4, [HostSlots("node2", "fast", 1)], tmp_path, cache))
        slurm.run(["scontrol", "update", "nodename=node2", "state=resume"])
        # node2's fast devices busy: job 5 waits for them, then node2 is drained under it
        busy = slurm.run(["sbatch", "--parsable", "--nodelist=node2", "--gres=gpu:fast:2", f"--chdir={tmp_path}",
                          "--wrap", "sleep 120"]).stdout.strip()
        running = ["squeue", "--noheader", "--states=RUNNING", f"--jobs={busy}", "--format=%i"]
        deadline = time.monotonic() + RUN_SECONDS
        while slurm.run(running).stdout.strip() != busy:
            assert time.monotonic() < deadline, f"Slurm job {busy} did not start on node2"
            time.sleep(0.2)
        job = launch(5, [HostSlots("node2", "fast", 1)], tmp_path, cache)
        backend.start(job)
        assert backend.poll(5) is None
        slurm.run(drain)
        assert wait(backend, 5) == 1
        assert open(job.log_path).read().splitlines()[-1].startswith(
            "error: Slurm node node2 is draining and cannot run job 5; resume it"), open(job.log_path).read()
        slurm.run(["scancel", busy])
    finally:
        slurm.run(["scontrol", "update", "nodename=node2", "state=resume"], check=False)
