"""The GPU acceptance checks as tests (``pytest -m cuda tests/test_cuda.py``): each step of
``megapipe.acceptance`` but the benchmark, run as ``tools/gpu_check.sh`` runs it (its own process and
deadline), passing when none of its checks failed. Skipped where no CUDA device exists."""

import pytest
import torch

from megapipe.acceptance import STEPS
from megapipe.acceptance.runner import run_step

pytestmark = [pytest.mark.system, pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("step", [s for s in STEPS if s.name != "benchmark"], ids=lambda s: s.name)
def test_acceptance_step(step, tmp_path):
    with open(tmp_path / "steps.log", "w") as log:
        result = run_step(step, 2 * step.budget_seconds, str(tmp_path), log, dry_run=False, benchmark_args=[])
    failed = [f"{c.name}: {c.detail}" for c in result.checks if c.outcome == "failed"]
    assert result.outcome == "passed", "\n".join(failed) or (tmp_path / "steps.log").read_text()[-4000:]
