"""The scheduler service's and worker agent's decisions and what they say, driven by hand, without processes.

The service runs on its embedded backend (``AgentsBackend``, in memory), with agents registered
through ``register_worker`` and their messages read through ``heartbeat``, as the HTTP routes
would. A queued job that no worker type can hold says why (``status``, the status page and
``tools/cluster.py status``), and submission gives the same reason at once (``submit --strict``
refuses the job instead, before it is journaled or queued); a run that reported its last
iteration is not stopped when the next round leaves it out (it is finishing on its own); the
service and the agent (against a scripted scheduler) announce each event once.
"""

import pytest

from megapipe.cluster.service.backends.base import HostSlots
from megapipe.cluster.service.journal import Journal
from megapipe.cluster.service.service import ClusterService
from megapipe.cluster.service.status_page import render_status_page
from megapipe.cluster.worker import agent as agent_module
from megapipe.cluster.worker.agent import WorkerAgent
from megapipe.errors import ConfigError
from cluster_helpers import load_cluster_tool

pytestmark = pytest.mark.unit

SMALL = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
         "--vocab-size", "128", "--train-iters", "10"]
NEEDS_TWO = ("it needs 2 devices of one type (--tensor-model-parallel-size x --pipeline-model-parallel-size) but "
             "no worker type has that many (the workers have 1 fast, 1 slow); start workers with --devices TYPE:N "
             "adding up to 2 of one type, or cancel it and submit it with a tensor x pipeline size of at most 1.")
WIDE = SMALL + ["--tensor-model-parallel-size", "2"]
# submit --strict's refusal: the same reason, whose fix resubmits (there is no queued job to cancel)
REFUSED = ("--strict refused the job, which no registered worker type can hold now: "
           + NEEDS_TWO.replace("cancel it and submit it", "submit it"))


@pytest.fixture
def service(tmp_path):
    lines = []
    made = ClusterService(Journal(str(tmp_path / "journal.db")), "max_min_fairness_perf", 10.0,
                          str(tmp_path / "work"), announce=lines.append)
    made.lines = lines
    return made


def stops(service, host):
    """The job ids the service told ``host``'s agent to stop since the last look."""
    return [m["stop"]["job_id"] for m in service.heartbeat(host, {}) if "stop" in m]


def test_a_job_no_worker_type_can_hold_says_why_everywhere(service):
    wide = service.submit("wide", 1.0, SMALL + ["--tensor-model-parallel-size", "2"])
    narrow = service.submit("narrow", 1.0, SMALL)
    assert service.status()["jobs"][wide]["waiting"].startswith("no worker is registered")
    service.register_worker("host-a", "127.0.0.1", {"fast": 1, "slow": 1}, {})
    service.before_round()
    jobs = service.status()["jobs"]
    assert jobs[wide]["waiting"] == NEEDS_TWO and jobs[narrow]["waiting"] is None
    assert service.status()["units"]["jct"] == "seconds"
    assert f"cannot be placed: {NEEDS_TWO}" in render_status_page(service.status())
    table = load_cluster_tool().status_table(service.status()).splitlines()
    assert table[table.index(next(line for line in table if " wide " in line)) + 1].strip() == \
        f"cannot be placed: {NEEDS_TWO}"
    service.register_worker("host-b", "127.0.0.1", {"fast": 1}, {})  # 2 fast devices over two hosts hold it
    service.before_round()
    assert service.status()["jobs"][wide]["waiting"] is None


def test_submission_gives_the_reason_status_shows_and_strict_refuses_before_journaling(service):
    service.register_worker("host-a", "127.0.0.1", {"fast": 1, "slow": 1}, {})
    service.before_round()
    with pytest.raises(ConfigError) as refused:
        service.submit("wide", 1.0, WIDE, strict=True)
    assert str(refused.value) == REFUSED
    assert service.journal.jobs() == [] and service.source.pending == []  # never journaled nor queued
    narrow = service.submit("narrow", 1.0, SMALL, strict=True)  # one a worker type can hold passes --strict
    wide = service.submit("wide", 1.0, WIDE)
    assert (narrow, wide) == (0, 1)
    assert (service.job_unplaceable(narrow), service.job_unplaceable(wide)) == (None, NEEDS_TWO)
    assert [job["waiting"] for job in service.status()["jobs"]] == [None, NEEDS_TWO]
    assert not any("refused" in line for line in service.lines)


def test_a_finishing_run_is_left_to_end_and_a_preempted_one_is_stopped(service):
    service.register_worker("host-a", "127.0.0.1", {"fast": 2}, {})
    service.before_round()
    finishing, preempted = service.submit("finishing", 1.0, SMALL), service.submit("preempted", 1.0, SMALL)
    for job_id in (finishing, preempted):
        service.launch(job_id, (HostSlots("host-a", "fast", 1),), lease_end=10.0)
    service.heartbeat("host-a", {})  # the launches
    service.lease_report(finishing, 1, {"iteration": 10, "exiting": True})  # its last iteration: saving, exiting
    service.lease_report(preempted, 1, {"iteration": 4})
    service.begin_round({}, end=20.0, renew=True)  # a round that places neither
    assert stops(service, "host-a") == [preempted]


def test_the_service_announces_each_event_once(service):
    service.submit("wide", 1.0, SMALL + ["--tensor-model-parallel-size", "2"])
    service.register_worker("host-a", "127.0.0.1", {"fast": 1, "slow": 1}, {"slow": 0.5})
    for _ in range(3):
        service.before_round()
    placed = {0: (HostSlots("host-a", "fast", 1),)}
    for placements in (placed, placed, placed, {}):
        service.begin_round(placements, end=10.0, renew=True)
    assert service.lines == [
        "job 0 (wide) submitted: 10 iterations on 2 devices, priority 1",
        "worker host-a registered: 1 fast, 1 slow, slow at 0.5 CPU each",
        f"job 0 cannot be placed: {NEEDS_TWO}",
        "round 1 (10 s): job 0 on host-a: 1 fast",
        "round 4 (10 s): no job placed",
    ]


def test_the_worker_announces_each_event_once(monkeypatch):
    """A scheduler that is down twice, then answers and asks to stop job 7, whose ranks then exit 0."""
    lines, calls = [], []
    agent = WorkerAgent("sched:1", "host-a", "127.0.0.1", {"fast": 1}, {}, announce=lines.append)

    class Ranks:
        code = None

        def stop(self, grace_seconds):
            self.code = 0

        def exit_code(self):
            return self.code

    def scheduler(url, body, timeout, key=None):
        calls.append(url)
        if len(calls) <= 2:
            raise ConnectionRefusedError("down")
        if body.get("running") == {"7": 0}:
            agent.stopping = True  # the exit went out: nothing more to see
        return {"ok": True} if url.endswith("/workers") else {
            "messages": [{"stop": {"job_id": 7, "grace_seconds": 60}}] if len(calls) == 4 else []}

    agent.jobs[7] = Ranks()
    monkeypatch.setattr(agent_module, "post_json", scheduler)
    monkeypatch.setattr(agent_module.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(agent_module.signal, "signal", lambda *handler: None)  # pytest's own SIGTERM stays
    agent.run()
    assert lines == [
        "no scheduler answers at http://sched:1; trying again every second",
        "worker host-a registered with the scheduler at http://sched:1: 1 fast",
        "the scheduler at http://sched:1 answers again",
        "job 7: stopping (SIGTERM; the job saves and exits, SIGKILL after 60 s)",
        "job 7: its ranks here ended with exit code 0",
    ]


def test_a_restarted_agents_jobs_end_even_those_it_never_reported():
    """An agent that dies between receiving a launch and its next heartbeat never reported the job's
    ranks; once it registers again, the job's run on that host still ends (LOST), and an exit code it
    did report, not yet polled, is kept."""
    from megapipe.cluster.service.backends.agents import LOST, AgentsBackend
    from megapipe.cluster.service.backends.base import Launch

    backend = AgentsBackend()
    backend.register("host-a", "127.0.0.1", {"fast": 2}, {})
    for job_id in (0, 1):
        backend.start(Launch(job_id, SMALL, (HostSlots("host-a", "fast", 1),), {}, "log"))
    backend.heartbeat("host-a", {"1": 0})  # job 1 ended well; job 0's ranks were never reported
    assert (backend.poll(0), backend.poll(1)) == (None, 0)
    backend.register("host-a", "127.0.0.1", {"fast": 2}, {})  # the agent was killed and started again
    assert (backend.poll(0), backend.poll(1)) == (LOST, 0)
