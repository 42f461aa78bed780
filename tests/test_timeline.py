"""Timelines: busy and idle time, JSON round trip, merging per-rank parts, Chrome traces."""

import json
from fractions import Fraction

import pytest

from megapipe.schedules.actions import Action, ActionKind, parse_action
from megapipe.schedules.catalog import build_schedule
from megapipe.schedules.analysis.simulate import simulate
from megapipe.schedules.analysis.timeline import Timeline

pytestmark = pytest.mark.unit


def hand_made():
    timeline = Timeline(meta={"schedule": "hand", "p": 2, "m": 1, "v": 1})
    for rank, text, start, end in [(0, "F0.0", 0, 1), (0, "SEND_F0.0>1", 1, 2), (0, "B0.0", 5, 7), (0, "STEP", 7, 8),
                                   (1, "RECV_F1.0<0", 0, 2), (1, "F1.0", 2, 3), (1, "B1.0", 3, 5), (1, "STEP", 5, 5)]:
        timeline.record(rank, parse_action(text), start, end)
    return timeline


def test_busy_time_counts_compute_only():
    assert hand_made().busy_time() == {0: 1 + 2 + 1, 1: 1 + 2}


def test_idle_fraction_over_own_span_and_over_a_window():
    timeline = hand_made()
    # rank 0 computes in [0, 8] for 4 units; rank 1 in [2, 5] for 3 units.
    assert timeline.idle_fraction() == {0: Fraction(4, 8), 1: Fraction(0)}
    assert timeline.idle_fraction(window=(0, 8)) == {0: Fraction(4, 8), 1: Fraction(5, 8)}


def test_save_and_load_round_trip(tmp_path):
    timeline = hand_made()
    path = tmp_path / "run.json"
    timeline.save(path)
    loaded = Timeline.load(path)
    assert loaded.meta == timeline.meta
    assert [(e.rank, e.action, e.start, e.end) for e in loaded.events] == \
        [(e.rank, e.action, float(e.start), float(e.end)) for e in timeline.events]


def test_load_rejects_other_json(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not a megapipe-timeline file"):
        Timeline.load(path)


def test_merge_of_per_rank_parts_is_the_whole():
    whole = simulate(build_schedule("1f1b", 3, 4)).timeline
    parts = [Timeline((e for e in whole.events if e.rank == rank), whole.meta) for rank in range(3)]
    merged = Timeline.merge(parts)
    assert sorted(map(repr, merged.events)) == sorted(map(repr, whole.events))
    assert merged.idle_fraction() == whole.idle_fraction()
    with pytest.raises(ValueError, match="whose schedule differs"):
        Timeline.merge([whole, Timeline(meta={"schedule": "gpipe"})])


def test_chrome_trace_has_one_track_per_rank(tmp_path):
    timeline = hand_made()
    path = tmp_path / "trace.json"
    timeline.to_chrome_trace(path, microseconds_per_unit=1000)
    trace = json.loads(path.read_text())["traceEvents"]
    slices = [e for e in trace if e["ph"] == "X"]
    assert len(slices) == len(timeline.events)
    b00 = next(e for e in slices if e["name"] == "B0.0")
    assert (b00["pid"], b00["tid"], b00["ts"], b00["dur"]) == (0, 0, 5000.0, 2000.0)
    send = next(e for e in slices if e["name"] == "SEND_F0.0>1")
    assert send["tid"] == 1  # communication on its own thread of the rank's track
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}


def test_recorded_actions_keep_their_identity():
    timeline = Timeline()
    action = Action(ActionKind.RECV_B, 2, 5, peer=3)
    timeline.record(2, action, 0.5, 0.75)
    assert Timeline.from_dict(json.loads(json.dumps(timeline.to_dict()))).events[0].action == action


def test_hidden_phases_count_an_all_to_all_only_while_another_action_computes():
    timeline = Timeline()
    forward, backward = parse_action("F0.1"), parse_action("&B0.0")
    timeline.record(0, forward, 0.0, 10.0)
    timeline.record(0, backward, 0.0, 12.0)
    timeline.record(0, forward, 2.0, 4.0, phase="dispatch")  # the backward computes throughout
    timeline.record(0, backward, 3.0, 6.0, phase="combine")  # the forward waits for 1 of its 3 seconds
    timeline.record(1, parse_action("F1.0"), 0.0, 20.0)  # another rank's compute hides nothing
    assert timeline.hidden_phases() == (2.0 - 1.0 + 3.0 - 1.0, 5.0)
    assert Timeline.from_dict(timeline.to_dict()) == timeline


def test_busy_time_counts_the_two_passes_of_an_overlapped_pair_once():
    timeline = Timeline()
    timeline.record(0, parse_action("F0.1"), 0, 10)
    timeline.record(0, parse_action("&B0.0"), 2, 12)
    timeline.record(0, parse_action("F0.2"), 14, 15)
    assert timeline.busy_time() == {0: 13}
    assert timeline.idle_fraction() == {0: Fraction(2, 15)}
