"""The streams an overlapped pair's passes run on (``pipeline/streams.py``), played with stand-in streams
over real lists: the two passes of every pair run on different streams (else the GPU would serialise
them whatever the host does, autograd running a backward where its forward ran), every pass of a stage
and microbatch runs where its forward did, and every stretch of side-stream work starts after the
main stream's work and is waited for by it. The executor's CPU runs, which have no streams, are the
training tests' (``tests/test_moe_overlap_training.py``)."""

import contextlib

import pytest
import torch

from megapipe.pipeline.streams import PassStreams
from megapipe.schedules.catalog import build_schedule, overlapped_schedule
from megapipe.schedules.replay import overlap_partners

pytestmark = pytest.mark.unit


class Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: "Stream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def _play(actions):
    """Runs ``actions`` as the executor does; returns each pass's stream per (kind, stage, microbatch) and the log."""
    log, current = [], ["main"]
    main, side = Stream("main", log), Stream("side", log)

    @contextlib.contextmanager
    def use(stream):
        current.append(stream.name)
        log.append(f"on {stream.name}")
        yield
        current.pop()

    streams = PassStreams(torch.device("cpu"), main, side, use)
    ran = {}
    pairs = {forward: backward for backward, forward in overlap_partners(actions).items()}
    paired = set(pairs.values())

    def run(action, context=contextlib.nullcontext):
        with context():
            ran[(action.kind.value, action.stage, action.microbatch)] = current[-1]
        if action.kind.value in ("B", "BW"):
            streams.finished((action.stage, action.microbatch))

    for i, action in enumerate(actions):
        if not action.kind.is_compute or i in paired:
            continue
        if i in pairs:
            backward = actions[pairs[i]]
            with streams.pair((action.stage, action.microbatch), (backward.stage, backward.microbatch)) as (f, b):
                run(action, f)
                run(backward, b)
        else:
            with streams.alone((action.stage, action.microbatch)):
                run(action)
    return ran, pairs, log


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 1, 6, 1), ("interleaved", 2, 8, 2),
                                           ("dualpipev", 2, 8, 2)])
def test_a_pair_never_shares_a_stream_and_a_microbatch_keeps_its_forwards(name, p, m, v):
    schedule = overlapped_schedule(build_schedule(name, p, m, v) if v > 1 else build_schedule(name, p, m))
    sides = 0
    for actions in schedule.actions:
        ran, pairs, log = _play(actions)
        assert pairs, "the lists hold overlapped pairs"
        for forward, backward in pairs.items():
            f, b = actions[forward], actions[backward]
            assert ran[("F", f.stage, f.microbatch)] != ran[(b.kind.value, b.stage, b.microbatch)]
        for (kind, stage, microbatch), stream in ran.items():
            assert stream == ran[("F", stage, microbatch)], (kind, stage, microbatch)
        sides += sum(stream == "side" for stream in ran.values())
        entries = [i for i, line in enumerate(log) if line == "on side"]
        for i in entries:  # the side stream waits for the main stream before it runs ...
            assert "side waits for main" in log[:i][-3:], log[max(0, i - 3):i + 1]
        assert log.count("side waits for main") == log.count("main waits for side")  # ... and is waited for
    assert sides > 0
