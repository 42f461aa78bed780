"""A megapipe job's row of the throughput matrix: the planner's prediction until the job has run on
a type, then what its own log measured there.

The log lines are megapipe's own (``IterationStats.line``), after the scheduler's lease lines. A
type's measured rate is every iteration logged there over the time the lines say they took,
leaving out each lease's first line (start-up); the expected rates below are that sum worked by
hand. The service is driven in-process (no agent process: the launch goes to an agent's outbox
that nobody fetches, and the test writes the job's log as its ranks would).
"""

import pytest

from megapipe.cluster.service.backends.base import HostSlots
from megapipe.cluster.service.job_log import MeasuredThroughput
from megapipe.cluster.service.job_spec import parse_job
from megapipe.cluster.service.journal import Journal
from megapipe.cluster.service.relayout import predicted_iterations_per_second
from megapipe.cluster.service.service import ClusterService
from megapipe.training.logger import IterationStats

pytestmark = pytest.mark.unit

JOB = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16", "--mock-data",
       "--vocab-size", "256", "--train-iters", "100"]


def iteration_line(iteration: int, milliseconds: float) -> str:
    return IterationStats(iteration, 100, 16 * iteration, milliseconds, 1e-4, 16, {"lm loss": 5.5}, None, 0.5, 0,
                          0, 16 * 64 / (milliseconds / 1000), 0.001, None, 0.3).line() + "\n"


def lease_line(lease: int, slots: str) -> str:
    return f"[cluster] lease {lease} on {slots}: pretrain_gpt.py --train-iters 100 --save ck --load ck\n"


def test_rates_per_type_from_the_iteration_lines_leaving_out_each_leases_first(tmp_path):
    log = tmp_path / "job.log"
    reader = MeasuredThroughput(str(log))
    assert reader.update() == {}  # no log yet
    text = (lease_line(1, "host-a:fastx1") + "> GPT training: ...\n" +
            "".join(iteration_line(i, ms) for i, ms in [(1, 900.0), (2, 100.0), (3, 100.0), (4, 200.0)]) +
            lease_line(2, "host-b:slowx2, host-a:slowx2") +
            "".join(iteration_line(i, ms) for i, ms in [(5, 1500.0), (7, 250.0), (9, 250.0)]))
    log.write_text(text + iteration_line(10, 50.0)[:40])  # the last line is still being written
    assert reader.update() == pytest.approx({"fast": 3 / 0.4, "slow": 4 / 1.0})
    with open(log, "a") as more:  # its end, then a third lease, on fast again
        more.write(iteration_line(10, 400.0)[40:] + lease_line(3, "host-b:fastx1") + iteration_line(11, 700.0) +
                   iteration_line(12, 100.0))
    assert reader.update() == pytest.approx({"fast": 4 / 0.5, "slow": 5 / 1.4})


def test_the_planner_predicts_a_type_until_the_jobs_log_measures_it(tmp_path):
    service = ClusterService(Journal(str(tmp_path / "journal.db")), "max_min_fairness_perf", 30.0,
                             str(tmp_path / "work"))
    service.register_worker("host-a", "127.0.0.1", {"fast": 1, "slow": 1}, {"slow": 0.5})
    job_id = service.submit("small", 1.0, JOB)
    service.before_round()
    spec, key = parse_job(JOB), (f"job{job_id}", 1)
    predicted = {"fast": predicted_iterations_per_second(spec, "fast", 1.0),
                 "slow": predicted_iterations_per_second(spec, "slow", 0.5)}
    assert predicted["slow"] < predicted["fast"]  # the planner sees the slow type's half CPU
    assert {t: service.table.alone(*key, t) for t in predicted} == predicted

    service.launch(job_id, (HostSlots("host-a", "fast", 1),), lease_end=30.0)  # writes the lease line
    with open(service.journal.job(job_id).log_path, "a") as log:  # what its rank prints
        log.write("".join(iteration_line(i, ms) for i, ms in [(1, 800.0), (2, 40.0), (3, 60.0)]))
    service.tick()
    measured = 2 / 0.1
    assert service.table.alone(*key, "fast") == pytest.approx(measured)
    assert service.table.alone(*key, "slow") == predicted["slow"]  # not run there yet
    assert service.status()["jobs"][0]["throughput"] == pytest.approx({"fast": measured})
    service.before_round()  # a new round does not put the prediction back
    assert service.table.alone(*key, "fast") == pytest.approx(measured)
