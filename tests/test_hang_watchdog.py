"""The hang watchdog (``training/hang_watchdog.py``): a collective one rank never enters is reported, within the
watchdog's time and long before the collective timeout, in one file naming the collective, its group and
the missing rank, with every rank's state, and one sentence; the stalled ranks exit with status 3.

Three processes: ranks 0 and 1 enter an all-reduce over the world; rank 2 stays in its own work (the fault)
and leaves once the report is written. The sentence is also checked on constructed states: a rank that
never answered (dead), a pipeline message, and no wait at all.
"""

from __future__ import annotations

import datetime
import json
import time

import pytest
import torch

from megapipe.parallel import progress
from megapipe.parallel.collectives import all_reduce
from megapipe.parallel.launch import job_store
from megapipe.testing.worlds import DistributedFailure, run_distributed
from megapipe.training.hang_watchdog import HANG_EXIT_STATUS, WRITTEN, HangWatchdog, hang_sentence

WATCHDOG_SECONDS = 2.0
COLLECTIVE_TIMEOUT = 120.0  # the watchdog must report long before this


def stuck_world(rank: int, world_size: int, report: str) -> str:
    HangWatchdog(rank, world_size, WATCHDOG_SECONDS, report, gather_seconds=10).start()
    all_reduce(torch.ones(1), None, world_size)  # every rank once: the collectives are numbered alike
    if rank < 2:
        progress.action("step 7, the loss all-reduce")
        all_reduce(torch.ones(1), None, world_size)  # rank 2 never enters: the watchdog ends this process
        return "the all-reduce finished"
    progress.action("a computation that never ends")
    job_store().wait([WRITTEN], datetime.timedelta(seconds=60))  # the fault: away until the report is out
    return "left"


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_collective_one_rank_never_enters_is_named_with_the_missing_rank(tmp_path):
    report = tmp_path / "hang_report.json"
    started = time.monotonic()
    # the stalled ranks exit with status 3; one whose peer exited first may see its blocked all-reduce fail on the
    # closed connection before its own exit: the report and the sentence are out either way
    with pytest.raises(DistributedFailure, match=f"exit code {HANG_EXIT_STATUS}|Connection closed by peer"):
        run_distributed(3, stuck_world, str(report), timeout=150, collective_timeout=COLLECTIVE_TIMEOUT)
    assert time.monotonic() - started < COLLECTIVE_TIMEOUT / 2
    written = json.loads(report.read_text())
    states = {int(rank): state for rank, state in written["ranks"].items()}
    assert sorted(states) == [0, 1, 2]
    for rank in (0, 1):
        assert states[rank]["waiting"]["name"] == "all_reduce" and states[rank]["waiting"]["number"] == 2
        assert states[rank]["waiting"]["ranks"] == [0, 1, 2] and states[rank]["action"] == "step 7, the loss all-reduce"
        assert any("stuck_world" in line for line in states[rank]["stack"])
    assert states[2]["waiting"] is None and states[2]["entered"] == {"0,1,2": 1}
    sentence = written["sentence"]
    assert sentence.startswith("rank ") and " in all_reduce number 2 over the world: rank 2 never entered it " \
        "(rank 2 is at a computation that never ends); where every rank is: " in sentence
    assert sentence.endswith(f"{report}.")


def state(action: str, entered: dict, waiting=None) -> dict:
    return {"action": action, "entered": entered, "waiting": waiting}


def collective(name: str, ranks: list[int], number: int, seconds: float, group: str = "the data group") -> dict:
    return {"name": name, "group": group, "ranks": ranks, "number": number, "seconds": seconds}


@pytest.mark.unit
def test_a_member_that_never_answered_is_named_dead_or_unreachable():
    states = {0: state("STEP", {"0,1": 5}, collective("all_reduce", [0, 1], 5, 31.0))}
    assert hang_sentence(0, states, 30, "r.json") == (
        "rank 0 has waited 31 s in all_reduce number 5 over the data group: rank 1 never answered (dead or "
        "unreachable); where every rank is: r.json.")


@pytest.mark.unit
def test_a_pipeline_message_names_its_peer_and_no_wait_names_the_action():
    waiting = collective("RECV_F 1.3 with global rank 0 (pipeline stage 0)", [0, 1], 0, 40.0)
    states = {1: state("F 1.3 of pipeline call 2", {}, waiting), 0: state("B 0.2 of pipeline call 2", {})}
    assert hang_sentence(1, states, 30, "r.json") == (
        "rank 1 waited 40 s on RECV_F 1.3 with global rank 0 (pipeline stage 0), which never came; where every "
        "rank is: r.json.")
    assert hang_sentence(0, {0: state("F 0.1", {})}, 30, "r.json") == (
        "rank 0 made no progress for 30 s in F 0.1; where every rank is: r.json.")


@pytest.mark.unit
def test_every_member_in_the_collective_blames_the_communication():
    both = {r: state("STEP", {"0,1": 3}, collective("all_reduce", [0, 1], 3, 10.0 + r)) for r in (0, 1)}
    assert "every member entered it; the communication itself is stuck" in hang_sentence(0, both, 5, "r.json")
