"""A lease renewal that waits for the next round does not slow the job down.

A job asks to renew when its lease would end within its next iterations; the service holds the
request until the next round extends or revokes the lease. That wait is not training time: the
job's next iteration time (what decides when it asks again) leaves it out, and a job slower than
half a round is answered once the next round renews its lease, not held until the request's
deadline. Counted, either wait made every later iteration ask and wait again (seconds per
iteration grew to the deadline, 2 rounds + 30 s, under a loaded machine).
"""

import pytest

from megapipe.lease import client as lease_module
from megapipe.lease.client import ClusterLease
from megapipe.cluster.service.backends.base import HostSlots
from megapipe.cluster.service.journal import Journal
from megapipe.cluster.service.service import ClusterService

pytestmark = pytest.mark.unit

SMALL = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
         "--vocab-size", "128", "--train-iters", "10"]


def test_the_time_a_renewal_waits_is_not_counted_as_an_iteration(monkeypatch):
    now, reports = [100.0], []

    def scheduler(url, body, timeout, key=None):
        reports.append(body)
        if body["renew"]:
            now[0] += 30.0  # held until the next round
        return {"expires_in": 1.0}

    monkeypatch.setattr(lease_module.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(lease_module, "post_json", scheduler)
    lease = ClusterLease("http://sched:1/leases/0/1")
    lease.start(0)
    for iteration in range(1, 6):
        now[0] += 0.5  # each iteration trains for half a second
        assert lease.stop_reason(iteration) is None
    renewals = [r for r in reports if r["renew"]]
    assert renewals, "the lease was never renewed"
    assert {r["seconds_per_iteration"] for r in reports[1:]} == {0.5}, reports


def test_a_job_slower_than_half_a_round_is_answered_at_the_next_round(tmp_path):
    service = ClusterService(Journal(str(tmp_path / "journal.db")), "max_min_fairness_perf", 10.0,
                             str(tmp_path / "work"))
    service.register_worker("host-a", "127.0.0.1", {"fast": 1}, {})
    service.before_round()
    job = service.submit("slow", 1.0, SMALL)
    hosts = (HostSlots("host-a", "fast", 1),)
    service.launch(job, hosts, lease_end=service.clock.now() + 1.0)  # its lease ends within the next iteration
    waits = []

    def next_round(timeout):  # while the renewal waits, the next round keeps the job on its workers
        waits.append(timeout)
        if len(waits) > 1:
            raise AssertionError("the renewal kept waiting after the next round renewed the lease")
        service.begin_round({job: hosts}, end=service.clock.now() + 10.0, renew=True)

    service.lease_changed.wait = next_round
    answer = service.lease_report(job, 1, {"iteration": 3, "seconds_per_iteration": 20.0, "renew": True})
    assert waits and answer["expires_in"] > 5.0, answer


def test_the_stragglers_a_run_reports_show_in_its_status(tmp_path):
    """Rank 0's lease carries the ranks the straggler check names (``training/stragglers.py``); the job's status
    shows the latest, and a report without the field keeps them."""
    service = ClusterService(Journal(str(tmp_path / "journal.db")), "max_min_fairness_perf", 10.0,
                             str(tmp_path / "work"))
    service.register_worker("host-a", "127.0.0.1", {"fast": 1}, {})
    service.before_round()
    job = service.submit("slowed", 1.0, SMALL)
    service.launch(job, (HostSlots("host-a", "fast", 1),), lease_end=service.clock.now() + 100.0)
    straggler = {"rank": 3, "host": "b", "phase": "forward and backward passes", "seconds": 1.3,
                 "peers_seconds": 1.0, "slower": 0.3}
    service.lease_report(job, 1, {"iteration": 20, "stragglers": [straggler]})
    service.lease_report(job, 1, {"iteration": 21})
    row = next(j for j in service.status()["jobs"] if j["id"] == job)
    assert row["stragglers"] == [straggler]
    service.lease_report(job, 1, {"iteration": 30, "stragglers": []})  # recovered
    assert next(j for j in service.status()["jobs"] if j["id"] == job)["stragglers"] == []
