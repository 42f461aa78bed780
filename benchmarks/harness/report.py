"""What a benchmark prints and writes: Markdown and fixed-width tables, the machine it ran on,
JSON reports (replaced atomically, so a run stopped early keeps what it finished) and the
Markdown result files under ``benchmarks/results/``."""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def markdown_row(cells: Sequence) -> str:
    """One line of a Markdown table (for tables printed row by row, as results come)."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def markdown(header: Sequence[str], rows: Iterable[Sequence] = ()) -> list[str]:
    """The lines of a Markdown table (its header and rule alone without ``rows``)."""
    return [markdown_row(header), "|" + "---|" * len(header)] + [markdown_row(row) for row in rows]


def print_markdown(header: Sequence[str], rows: Iterable[Sequence]) -> None:
    """A Markdown table after a blank line, as the docs' tables are written."""
    print("\n" + "\n".join(markdown(header, rows)))


def print_ruled(header: str) -> None:
    """A fixed-width table's header line and a rule as long."""
    print(header)
    print("-" * len(header))


def load_average() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def machine() -> str:
    """``N CPU cores, load average L at start``: the line that lets a reader judge the noise."""
    return f"{os.cpu_count()} CPU cores, load average {load_average()} at start"


def write_json(path: str, report) -> None:
    """``report`` as JSON at ``path``, replaced atomically (no-op without a path)."""
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def write_result(name: str, title: str, command: str, lines: Sequence[str], note: str = "") -> None:
    """``benchmarks/results/<name>.md``: a title, the command that made it (and ``note``), the lines."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name + ".md"), "w") as f:
        f.write(f"# {title}\n\n`{command}`{note}\n\n" + "\n".join(lines) + "\n")
