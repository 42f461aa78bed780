"""A schedule as a text grid: one row per rank, one column per list position.

Used in every ScheduleError so a bad action is shown in context, and handy for humans::

    pos      0     1     2     3     4     5
    rank 0   F0.0  F0.1  B0.0  F0.2  B0.1  ...
    rank 1   F1.0  B1.0  F1.1  B1.1  ...
                   ^^^^
"""

from __future__ import annotations

from typing import Iterable

from megapipe.schedules.actions import Schedule


def format_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = ()) -> str:
    """Render ``schedule``; each (rank, position) in ``marks`` gets a ``^`` underline."""
    marks = set(marks)
    rows = [[str(action) for action in rank_actions] for rank_actions in schedule.actions]
    columns = max((len(row) for row in rows), default=0)
    widths = [max([len(str(c))] + [len(row[c]) for row in rows if c < len(row)]) for c in range(columns)]
    label_width = len(f"rank {schedule.p - 1}")

    def line(label: str, cells: list[str]) -> str:
        return "  ".join([label.ljust(label_width)] + [cell.ljust(widths[c]) for c, cell in enumerate(cells)]).rstrip()

    lines = [f"{schedule.name} (p={schedule.p}, m={schedule.m}, v={schedule.v})",
             line("pos", [str(c) for c in range(columns)])]
    for rank, row in enumerate(rows):
        lines.append(line(f"rank {rank}", row))
        marked = [c for c in range(len(row)) if (rank, c) in marks]
        if marked:
            lines.append(line("", ["^" * len(cell) if c in marked else "" for c, cell in enumerate(row)]))
    return "\n".join(lines)
