"""The suite's lanes under ``pytest -n 3`` (``parallel_lanes.py``): every paced and longest file exists, the
paced lane comes first, whole files keep together in tier order, the longest of a tier first in it, and a
background test moves the worker and the process server it forks from to the background's niceness and
CPU group, and nothing raises them back."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import parallel_lanes

pytestmark = pytest.mark.unit

HERE = Path(__file__).parent


def test_every_paced_and_longest_file_exists():
    named = parallel_lanes.PACED_FILES + parallel_lanes.LONGEST_FILES
    assert [name for name in named if not (HERE / name).is_file()] == []


def _item(name: str, tier: str):
    return SimpleNamespace(path=HERE / name, tier=tier)


def test_the_paced_lane_comes_first_then_whole_files_by_their_heaviest_tier():
    items = [_item("test_a.py", "unit"), _item("test_b.py", "unit"), _item("test_b.py", "system"),
             _item("test_preemption.py", "system"), _item("test_c.py", "distributed"),
             _item("test_cluster_crash.py", "system"), _item("test_a.py", "unit")]
    parallel_lanes.order_for_workers(items, lambda item: item.tier)
    assert [(item.path.name, item.tier) for item in items] == [
        ("test_preemption.py", "system"), ("test_cluster_crash.py", "system"),  # paced, in collection order
        ("test_b.py", "unit"), ("test_b.py", "system"),  # a file with a system test, kept whole
        ("test_c.py", "distributed"), ("test_a.py", "unit"), ("test_a.py", "unit")]
    assert {parallel_lanes.group_of(item) for item in items[:2]} == {parallel_lanes.PACED_GROUP}
    assert parallel_lanes.group_of(items[2]) == "test_b.py"


def test_the_longest_file_of_a_tier_goes_first_in_it(monkeypatch):
    monkeypatch.setattr(parallel_lanes, "LONGEST_FILES", ("test_z.py",))
    items = [_item("test_a.py", "unit"), _item("test_d.py", "distributed"), _item("test_z.py", "unit"),
             _item("test_b.py", "unit")]
    parallel_lanes.order_for_workers(items, lambda item: item.tier)
    assert [item.path.name for item in items] == ["test_d.py", "test_z.py", "test_a.py", "test_b.py"]


def test_a_background_test_moves_the_worker_and_its_process_server_down_never_up(monkeypatch, tmp_path):
    pids = [os.getpid(), 4242]  # the worker, and the process server that forks its scripts and ranks
    niceness = dict.fromkeys(pids, 0)
    monkeypatch.setattr(os, "getpriority", lambda which, pid: niceness[pid])
    monkeypatch.setattr(os, "setpriority", lambda which, pid, value: niceness.update({pid: value}))
    group = tmp_path / "background"  # a control group's directory, with its one file used here
    group.mkdir()
    parallel_lanes.lower_priority(pids, str(group))
    assert niceness == dict.fromkeys(pids, parallel_lanes.BACKGROUND_NICENESS)
    assert (group / "cgroup.procs").read_text().split() == [str(pid) for pid in pids]
    niceness.update(dict.fromkeys(pids, 19))
    parallel_lanes.lower_priority(pids, None)  # no control group: niceness alone, and never raised
    assert niceness == dict.fromkeys(pids, 19)
