"""User-written schedules: read and write action lists as text or CSV.

Text (any suffix but .csv): one line per pipeline rank, actions in their text form separated
by spaces; blank lines and lines starting with ``#`` are skipped::

    # 1F1B, p=2, m=2
    F0.0 F0.1 B0.0 B0.1 STEP
    F1.0 B1.0 F1.1 B1.1 STEP

CSV (.csv): one action per row, ``rank,kind,stage,microbatch[,peer]``, an optional header row,
rows of a rank in order; STEP rows leave stage and microbatch empty; an overlapped backward's
kind is written ``&B`` (or ``&BI``).

p is the number of ranks, m the highest microbatch + 1, and v the number of stages / p. The
placement is read off the lists: with v = 2 and the last stage 2p-1 on rank 0 it is the V
(``layout/placement.py``), otherwise looped. Compute-only lists get their sends and receives
inserted; lists that already have them are validated as written.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

from megapipe.errors import ConfigError, ScheduleError
from megapipe.schedules.actions import Action, ActionKind, Schedule, parse_action
from megapipe.schedules.catalog import lower_schedule, names_where
from megapipe.schedules.validate import validate_schedule
from megapipe.schedules.validate_updates import is_asynchronous
from megapipe.layout.placement import Placement

_CSV_HEADER = ["rank", "kind", "stage", "microbatch", "peer"]


def load_schedule(path, name: Optional[str] = None) -> Schedule:
    """Read, complete and validate the schedule in ``path`` (named after the file by default)."""
    path = Path(path)
    if not path.is_file():
        raise ScheduleError(f"schedule file {path} does not exist; check the path.")
    lists = _read_csv(path) if path.suffix == ".csv" else _read_text(path)
    schedule = _schedule_from_lists(name or path.stem, lists, path)
    if schedule.has_communication:
        validate_schedule(schedule)
        return schedule
    return lower_schedule(schedule)


def load_training_schedule(path, p: int, m: int, v: int) -> Schedule:
    """``--schedule-file`` of the training scripts: a flush schedule for exactly this run's p, m and v
    (its placement is the file's, see the module docstring)."""
    schedule = load_schedule(path)
    if is_asynchronous(schedule):
        raise ConfigError(f"--schedule-file {path} updates with UPDATE actions; the training scripts run flush "
                          f"schedules from files (one STEP per rank); use --pipeline-schedule {names_where('asynchronous')}.")
    if (schedule.p, schedule.m, schedule.v) != (p, m, v):
        raise ConfigError(f"--schedule-file {path} is written for p={schedule.p}, m={schedule.m}, v={schedule.v}, but "
                          f"this run has p={p} (--pipeline-model-parallel-size), m={m} microbatches (--global-batch-size"
                          f" / (--micro-batch-size x data-parallel size)) and v={v}; write the file for these sizes.")
    return schedule


def save_schedule(schedule: Schedule, path) -> None:
    """Write ``schedule``'s lists as text, or as CSV when ``path`` ends in .csv."""
    path = Path(path)
    if path.suffix != ".csv":
        path.write_text(schedule.to_text())
        return
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_CSV_HEADER)
        for rank, actions in enumerate(schedule.actions):
            for a in actions:
                kind = ("&" if a.overlapped else "") + a.kind.value
                writer.writerow([rank, kind, _blank(a.stage), _blank(a.microbatch), _blank(a.peer)])


def _blank(value: Optional[int]) -> str:
    return "" if value is None else str(value)


def _read_text(path: Path) -> list[list[Action]]:
    lists = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            lists.append([parse_action(token) for token in line.split()])
        except ScheduleError as error:
            raise ScheduleError(f"{path} line {number}: {error}") from None
    return lists


def _read_csv(path: Path) -> list[list[Action]]:
    by_rank: dict[int, list[Action]] = {}
    with open(path, newline="") as f:
        for number, row in enumerate(csv.reader(f), start=1):
            cells = [cell.strip() for cell in row]
            if not any(cells) or (number == 1 and cells[0] == "rank"):
                continue
            try:
                rank, action = _action_from_row(cells)
            except (ScheduleError, ValueError) as error:
                raise ScheduleError(f"{path} line {number}: cannot read {','.join(row)!r} ({error}); write rows as "
                                    "rank,kind,stage,microbatch[,peer], e.g. 0,F,0,3.") from None
            by_rank.setdefault(rank, []).append(action)
    missing = sorted(set(range(max(by_rank, default=-1) + 1)) - set(by_rank))
    if missing:
        raise ScheduleError(f"{path} has no actions for rank {missing[0]}; every rank from 0 to the highest needs "
                            "its list.")
    return [by_rank[rank] for rank in sorted(by_rank)]


def _action_from_row(cells: list[str]) -> tuple[int, Action]:
    cells = cells + [""] * (len(_CSV_HEADER) - len(cells))
    rank, kind, stage, microbatch, peer = cells[:len(_CSV_HEADER)]

    def number(text: str) -> Optional[int]:
        return int(text) if text else None

    return int(rank), Action(ActionKind(kind.removeprefix("&")), number(stage), number(microbatch), peer=number(peer),
                             overlapped=kind.startswith("&"))


def _schedule_from_lists(name: str, lists: list[list[Action]], path: Path) -> Schedule:
    if not lists:
        raise ScheduleError(f"{path} holds no actions; write one line of actions per pipeline rank.")
    p = len(lists)
    compute = [a for actions in lists for a in actions if a.kind.is_compute]
    if not compute:
        raise ScheduleError(f"{path} has no F or B actions; every stage needs one F and one B per microbatch.")
    stages = max(a.stage for a in compute) + 1
    if stages % p:
        raise ScheduleError(f"{path} uses stages 0..{stages - 1} on {p} ranks, but the number of stages must be a "
                            f"multiple of the number of ranks (p x v); add or remove stages.")
    v = stages // p
    on_first_rank = {a.stage for a in lists[0] if a.kind.is_compute}
    placement = Placement.V if v == 2 and p > 1 and stages - 1 in on_first_rank else Placement.LOOPED
    return Schedule(name, p, max(a.microbatch for a in compute) + 1, v, lists, placement=placement)
