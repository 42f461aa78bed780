"""The service's pieces that need no processes: journal, submission checks, re-planning, the lease's client.

Journal: what one connection wrote, a new connection (a restarted service) reads back; a write
that fails leaves the row as it was (one transaction). Submission: a command is refused with
the very sentence the training script would print (``parse_config`` called directly is the
reference), and the flags the scheduler owns are refused. Re-planning: the command for an
allocation keeps every other flag and carries the planner's best layout for those hosts.
"""

import sqlite3

import pytest

from megapipe.cli.parse import parse_config
from megapipe.cluster.service.backends.base import HostSlots
from megapipe.cluster.service.job_log import layout_key
from megapipe.cluster.service.job_spec import parse_job
from megapipe.cluster.service.journal import Journal
from megapipe.cluster.service.relayout import best_layout, layout_command
from megapipe.errors import ConfigError

pytestmark = pytest.mark.unit

SMALL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--global-batch-size", "16", "--mock-data", "--vocab-size", "256"]


def test_journal_survives_a_new_connection_and_a_failed_write_changes_nothing(tmp_path):
    path = str(tmp_path / "journal.db")
    journal = Journal(path)
    first = journal.add_job("a", "gpt", ["pretrain_gpt.py", "--train-iters", "9"], 9, 1, 2.0, "logs", "ckpt")
    second = journal.add_job("b", "bert", ["pretrain_bert.py"], 500, 2, 1.0, "logs", "ckpt")
    journal.update(first, state="running", iterations=4, allocation=[["host-a", "fast", 1]], throughputs={"fast": 2.5})
    with pytest.raises(sqlite3.IntegrityError):
        journal.update(second, state="running", name=None)  # NOT NULL: the whole update is refused
    reopened = Journal(path)  # a restarted service
    rows = {row.id: row for row in reopened.jobs()}
    assert (first, second) == (0, 1)
    assert rows[first].state == "running" and rows[first].iterations == 4 and rows[first].priority == 2.0
    assert rows[first].allocation == [["host-a", "fast", 1]] and rows[first].throughputs == {"fast": 2.5}
    assert rows[first].command == ["pretrain_gpt.py", "--train-iters", "9"] and rows[first].log_path == "logs/job0.log"
    assert rows[second].state == "queued" and rows[second].name == "b" and rows[second].save_dir == "ckpt/job1"


@pytest.mark.parametrize("flags", [
    ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
    ["--global-batch-size", "10", "--micro-batch-size", "4"],
    ["--mock-data"],
])
def test_submission_is_refused_with_the_training_scripts_own_sentence(flags):
    with pytest.raises(ConfigError) as expected:
        parse_config("gpt", flags, world_size=2 if "--pipeline-model-parallel-size" in flags else 1)
    with pytest.raises(ConfigError) as refused:
        parse_job(["pretrain_gpt.py"] + flags)
    assert str(refused.value) == str(expected.value)


@pytest.mark.parametrize("command, sentence", [
    (["pretrain_gpt.py", "--save", "x"], "--save is set by the scheduler for every allocation of the job; drop it "
                                         "from the submitted command."),
    (["train.py"], "the job's command starts with 'train.py'; start it with one of pretrain_gpt.py, pretrain_bert.py."),
    (["pretrain_gpt.py", "--no-such-flag"], "unknown flag --no-such-flag; pretrain_gpt.py --help lists the flags."),
])
def test_submission_refuses_what_the_scheduler_owns_or_cannot_run(command, sentence):
    with pytest.raises(ConfigError) as refused:
        parse_job(command)
    assert str(refused.value) == sentence


def test_an_allocation_gets_the_planners_layout_and_keeps_every_other_flag():
    spec = parse_job(["pretrain_gpt.py", "--tensor-model-parallel-size", "2", "--train-iters", "7", "--seed", "5"]
                     + SMALL)
    for hosts in [(HostSlots("a", "fast", 2),), (HostSlots("a", "slow", 1), HostSlots("b", "slow", 1))]:
        command = layout_command(spec, hosts, speed=0.5)
        candidate = best_layout(spec, hosts, speed=0.5).candidate
        assert layout_key(command, 2) == (candidate.tensor, candidate.pipeline, candidate.data, candidate.schedule, 4)
        assert command[command.index("--seed") + 1] == "5" and command[command.index("--train-iters") + 1] == "7"
        assert parse_job(command).target_iters == 7
    # 3 layers, 3 heads of an odd width, one microbatch: no t, p or d of 2 exists, the submitted layout stays
    unsplittable = parse_job(["pretrain_gpt.py", "--num-layers", "3", "--hidden-size", "63", "--num-attention-heads",
                              "3", "--global-batch-size", "4", "--micro-batch-size", "4", "--mock-data", "--vocab-size",
                              "64"])
    assert layout_command(unsplittable, (HostSlots("a", "fast", 2),), 1.0) == unsplittable.command
