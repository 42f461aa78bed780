"""What a step found: named checks (passed, failed or skipped, with a detail and numbers), appended to
a JSON-lines file the moment each is made, so a step stopped by its deadline keeps what it did."""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from megapipe.errors import first_line


@dataclass
class Check:
    name: str
    outcome: str  # "passed", "failed", "skipped" or "noted" (a figure reported, not judged)
    detail: str = ""
    values: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Context:
    """Where a step runs: its device, a scratch folder, whether it is a CPU dry run, extra arguments
    for the benchmark, and the step's deadline (seconds from its start)."""

    device: torch.device
    work: str
    dry_run: bool
    benchmark_args: tuple = ()
    budget_seconds: float = float("inf")


class Record:
    """The checks of one step, each written to ``path`` (one JSON object per line) as it is added."""

    def __init__(self, path: str):
        self.path = path
        open(path, "w").close()

    def add(self, name: str, outcome: str, detail: str = "", **values) -> Check:
        check = Check(name, outcome, detail, values)
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(check)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"[{outcome}] {name}" + (f": {detail}" if detail else ""), flush=True)
        return check

    def check(self, name: str, test: Callable[[], Optional[str]]) -> bool:
        """Run ``test``: passed with the detail it returns, failed with the first line of what it
        raised (an AssertionError's message says what differed)."""
        try:
            detail = test()
        except Exception as error:  # noqa: BLE001 - any failure of a check is that check's result
            traceback.print_exc()
            self.add(name, "failed", first_line(error))
            return False
        self.add(name, "passed", detail or "")
        return True

    def skip(self, name: str, why: str) -> None:
        self.add(name, "skipped", why)


def read_checks(path: str) -> list[Check]:
    """The checks a step wrote (an unfinished last line, from a step killed while writing, is dropped)."""
    checks = []
    if not os.path.exists(path):
        return checks
    with open(path) as f:
        for line in f:
            try:
                checks.append(Check(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                continue
    return checks


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, scale: float, what: str) -> None:
    """``actual`` within ``rtol`` of each element of ``expected`` plus ``scale`` x its largest magnitude
    (for sums that cancel to near zero), compared in fp32; the message names the worst element."""
    actual, expected = actual.float(), expected.float()
    allowed = rtol * expected.abs() + scale * expected.abs().max()
    excess = (actual - expected).abs() - allowed
    if excess.max() > 0:
        worst = int(excess.argmax())
        raise AssertionError(f"{what}: {actual.flatten()[worst].item():.6g} vs {expected.flatten()[worst].item():.6g} "
                             f"at element {worst} ({int((excess > 0).sum())} of {excess.numel()} outside "
                             f"rtol {rtol:g} + {scale:g} x max)")
