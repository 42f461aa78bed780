"""The scheduler and its agents killed at random moments: every job finishes exactly once, none is lost,
none runs twice at once, and the journal keeps its invariants.

A ``LocalCluster`` (FIFO, short rounds, two hosts of one device each on the loopback address) runs
a trace of tiny GPT jobs to their targets while a seeded random schedule SIGKILLs the scheduler
``SCHEDULER_KILLS`` times and an agent ``AGENT_KILLS`` times, each after a random delay (the random
variable is the kill moment; everything else waits on observable conditions with deadlines), and
starts each again at once. After every restart the journal's invariants are checked
(``journal_invariants.py``); throughout, a watcher samples the process table for training ranks of
two different launches (leases) of one job alive at once. At the end every job is done with its
target iterations checkpointed, marked finished once, and its log shows no two runs at once.
``MEGAPIPE_CRASH_SEED`` draws another schedule of kills (to hunt; the suite runs the default).
"""

import os
import random
import re
import signal
import threading
import time

import pytest

from journal_invariants import JournalWatch
from megapipe.checkpointing.paths import read_latest
from megapipe.cluster.service.job_log import overlapping_runs
from megapipe.cluster.service.local_cluster import LocalCluster

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

SCHEDULER_KILLS, AGENT_KILLS = 6, 3
BETWEEN_KILLS = (2.0, 8.0)  # seconds: the random delay before each kill
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "64",
         "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1"]
JOBS = {"a": 1200, "b": 1600, "c": 800}  # name -> target iterations: each runs through several kills


class LaunchWatch:
    """Samples the process table: (job, {leases}) whenever training ranks of two launches of one job of the
    scheduler at ``address`` live (other clusters may run on the machine)."""

    def __init__(self, address: str):
        self.lease = re.compile(rf"--cluster-lease http://{re.escape(address)}/leases/(\d+)/(\d+)")
        self.overlaps: list[tuple[int, set]] = []
        self.samples = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(0.2):
            leases: dict[int, set] = {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                match = self.lease.search(command)
                if match and "torch.distributed.run" not in command:  # a rank, not its torchrun
                    leases.setdefault(int(match[1]), set()).add(int(match[2]))
            self.samples += 1
            self.overlaps += [(job, found) for job, found in leases.items() if len(found) > 1]

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()


def _kill_leftovers(work_dir: str) -> None:
    """Ranks of this test's jobs that outlived their killed agent and the cluster's close (their command
    lines name this test's directory)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if work_dir.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def test_jobs_survive_a_scheduler_and_agents_killed_at_random_moments(tmp_path):
    rng = random.Random(f"cluster-kills-{os.environ.get('MEGAPIPE_CRASH_SEED', 0)}")
    kills = ["scheduler"] * SCHEDULER_KILLS + ["agent"] * AGENT_KILLS
    rng.shuffle(kills)
    cluster = LocalCluster(str(tmp_path), "fifo", 3, {"host-a": "fast:1", "host-b": "fast:1"}, throttle="")
    watch = journal = None
    try:
        cluster.start()
        watch, journal = LaunchWatch(cluster.address), JournalWatch(cluster.journal)
        ids = {name: cluster.submit(name, ["pretrain_gpt.py", *MODEL, "--train-iters", str(iters)])["id"]
               for name, iters in JOBS.items()}
        cluster.wait_for(lambda: any(j["iterations"] > 0 for j in cluster.status()["jobs"]), 120, "a job to train")
        problems = []
        running_at_kills = 0
        for victim in kills:
            time.sleep(rng.uniform(*BETWEEN_KILLS))  # the kill moment, drawn at random
            running_at_kills += sum(j["state"] == "running" for j in journal.rows())
            if victim == "scheduler":
                cluster.kill(cluster.scheduler)
                cluster.start_scheduler()
            else:
                host = rng.choice(sorted(cluster.agents))
                cluster.kill(cluster.agents[host])
                cluster.start_agent(host)
            problems += [f"after killing the {victim}: {p}" for p in journal.check()]
        cluster.wait_for(lambda: all(j["state"] in ("done", "failed") for j in cluster.status()["jobs"]), 400,
                         "every job to finish")
        problems += journal.check()
        jobs = {j["name"]: j for j in cluster.status()["jobs"]}
    finally:
        if watch is not None:
            watch.close()
        cluster.close()
        _kill_leftovers(str(tmp_path))
    assert problems == []
    twice = {name: overlapping_runs(open(job["log"]).read()) for name, job in jobs.items()}
    assert watch.samples > 0 and watch.overlaps == [] and all(v == [] for v in twice.values()), (watch.overlaps, twice)
    rows = {row["id"]: row for row in journal.rows()}
    for name, job in jobs.items():
        assert job["state"] == "done" and job["iterations"] == JOBS[name], job
        assert read_latest(rows[ids[name]]["save_dir"]) == JOBS[name]
        assert open(job["log"]).read().count("[cluster] done:") <= 1  # the scheduler said it once at most
    print(f"{SCHEDULER_KILLS} scheduler kills, {AGENT_KILLS} agent kills, {running_at_kills} jobs running at them: "
          f"{len(jobs)} jobs done, 0 lost, 0 run twice ({sum(r['lease'] for r in rows.values())} launches, "
          f"{watch.samples} process-table samples)")
