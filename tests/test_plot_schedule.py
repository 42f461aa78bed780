"""The schedule picture and its command-line tool."""

import json
import sys
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.colors import to_rgba

from megapipe.schedules.actions import ActionKind
from megapipe.schedules.analysis.plot import BACKWARD_COLOR, FORWARD_COLOR, chunk_color, draw_simulation, draw_timeline
from megapipe.schedules.schedule_file import load_training_schedule
from megapipe.schedules.catalog import build_schedule
from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.schedules.analysis.timeline import Timeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import plot_schedule  # noqa: E402

pytestmark = pytest.mark.unit


def box_colors(figure):
    """Face colours of all drawn boxes, one entry per box."""
    colors = []
    for collection in figure.axes[0].collections:
        colors += [tuple(c) for c in collection.get_facecolors()] * len(collection.get_paths())
    return colors


def test_picture_shows_every_compute_box_with_its_chunk_shade_and_number():
    schedule = build_schedule("interleaved", 2, 4, 2)
    result = simulate(schedule, CostModel.per_chunk(2))
    figure = draw_simulation(result)
    colors = box_colors(figure)
    events = [e for e in result.timeline.events if e.action.kind.is_compute]
    for kind, base in ((ActionKind.F, FORWARD_COLOR), (ActionKind.B, BACKWARD_COLOR)):
        for chunk in range(2):
            expected = sum(1 for e in events if e.action.kind is kind and e.action.stage // 2 == chunk)
            assert colors.count(to_rgba(chunk_color(base, chunk, 2))) == expected == 2 * 4  # p stages per chunk, m microbatches each
    labels = sorted((round(t.get_position()[0], 6), t.get_position()[1], t.get_text())
                    for t in figure.axes[0].texts if not t.get_text().startswith("idle"))
    assert labels == sorted((round(float(e.start + e.end) / 2, 6), e.rank, str(e.action.microbatch)) for e in events)
    assert "bubble 11.1%" in figure.axes[0].get_title(loc="left")  # (p-1)/(vm+p-1) = 1/9


def test_tool_draws_a_simulated_schedule_and_writes_traces(tmp_path, capsys):
    png, trace, saved = tmp_path / "s.png", tmp_path / "trace.json", tmp_path / "timeline.json"
    code = plot_schedule.main(["--schedule", "interleaved", "-p", "4", "-m", "8", "-v", "2", "-o", str(png),
                               "--chrome-trace", str(trace), "--save-timeline", str(saved)])
    assert code == 0
    out = capsys.readouterr().out
    assert "makespan 57/2" in out and "bubble 3/19" in out  # (vm + p - 1) 3 / v and (p-1)/(vm+p-1)
    assert "peak activations per rank (stages): 11/2, 9/2, 7/2, 5/2" in out
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > height > 100
    assert len([e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]) == \
        len(Timeline.load(saved).events)


def test_tool_draws_a_recorded_timeline(tmp_path):
    recorded = Timeline(meta={"schedule": "1f1b", "p": 2, "m": 2, "v": 1})
    for event in simulate(build_schedule("1f1b", 2, 2), CostModel(forward=0.01, backward=0.02)).timeline.events:
        recorded.record(event.rank, event.action, 1.7e9 + event.start, 1.7e9 + event.end)  # wall-clock seconds
    path = tmp_path / "run.json"
    recorded.save(path)
    assert plot_schedule.main(["--timeline", str(path)]) == 0
    assert (tmp_path / "run.png").is_file()
    figure = draw_timeline(Timeline.load(path))
    assert figure.axes[0].get_xlim() == pytest.approx((0, 0.01 * 3 * 3))


def test_tool_reports_bad_input(capsys):
    assert plot_schedule.main(["--schedule", "1f1b", "-p", "4", "-m", "2"]) == 2
    assert "fewer than --pipeline-model-parallel-size 4" in capsys.readouterr().err


def test_tool_searches_prints_the_named_schedules_and_saves_a_runnable_file(tmp_path, capsys):
    saved = tmp_path / "auto.txt"
    code = plot_schedule.main(["--search", "-p", "2", "-m", "4", "--forward-time", "1,3/2", "--backward-time", "2,3",
                               "--schedule-memory-limit", "2", "-o", str(tmp_path / "a.png"),
                               "--save-schedule", str(saved)])
    assert code == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:8] if line.split()[0] in
            ("auto", "1f1b", "zb-h1", "zb-h2", "gpipe")}
    assert set(rows) == {"auto", "1f1b", "zb-h1", "zb-h2", "gpipe"}
    assert float(rows["auto"][2]) <= min(float(row[2]) for row in rows.values())  # batch time
    assert "over the limit" in " ".join(rows["gpipe"])  # gpipe holds all 4 microbatches
    schedule = load_training_schedule(saved, 2, 4, 1)  # what --schedule-file runs
    assert schedule.name == "auto"


def test_tool_names_an_infeasible_memory_limit(capsys):
    assert plot_schedule.main(["--search", "-p", "2", "-m", "4", "--schedule-memory-limit", "0"]) == 2
    assert "--schedule-memory-limit 0 is below" in capsys.readouterr().err
