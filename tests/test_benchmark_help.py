"""Every benchmark script answers ``--help`` with its usage and exits, before it benchmarks anything.

Each script runs as ``__main__`` in this process (as ``python benchmarks/NAME.py --help`` would,
with ``benchmarks/`` first on the path for the shared ``harness``); a script that ignored its
arguments would start its benchmark instead and outlive the timeout.
"""

import runpy
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in path.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_help_prints_the_usage_and_exits(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(script), run_name="__main__")
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script.name} ")
