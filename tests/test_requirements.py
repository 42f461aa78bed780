"""``requirements.txt`` is the one list of runtime dependencies: the installed package's metadata (which
``pyproject.toml`` fills from that file) names exactly the same packages, so the two cannot drift."""

from __future__ import annotations

import re
from importlib.metadata import requires
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _listed() -> list[str]:
    lines = (line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines())
    return [line for line in lines if line]


def test_the_installed_metadata_is_requirements_txt():
    runtime = [entry for entry in requires("megapipe") if "extra ==" not in entry]
    assert runtime == _listed()


def test_torch_is_left_to_the_machine():
    """An unpinned torch would pull a CUDA build over the one a machine has; install.sh chooses it."""
    names = [re.split(r"[<>=!~;\[ ]", entry)[0].lower() for entry in _listed()]
    assert "torch" not in names and names
