"""The GPU acceptance runner (megapipe.acceptance): each step in its own process with its own
deadline, so a failing, raising, dying or hanging step costs only itself and the next still runs,
and the summary names what went wrong; and a dry run of the quick steps on the CPU."""

import json
import os

import pytest

from megapipe.acceptance import MULTI_STEPS, STEPS, Step
from megapipe.acceptance import multi_parity, runner

TESTS = os.path.dirname(os.path.abspath(__file__))
# Starting a step's process (Python, torch) takes seconds on a loaded machine: the budgets leave room
# for that; the hanging step's is the shortest that still lets it record its first check.
FAKES = [Step(name, f"acceptance_fakes:{name}", 20 if name == "hangs" else 120, f"a step that {name}")
         for name in ("passes", "fails", "raises", "dies", "hangs", "passes")]


@pytest.fixture
def fake_steps(monkeypatch):
    monkeypatch.setattr(runner, "STEPS", FAKES)
    monkeypatch.setattr(runner, "DRY_RUN_SCALE", 1)
    monkeypatch.setenv("PYTHONPATH", TESTS)


@pytest.mark.system
def test_every_step_runs_and_the_summary_says_what_went_wrong(fake_steps, tmp_path):
    results = runner.run_all(str(tmp_path), dry_run=True, only=[], benchmark_args=[])
    assert [r.outcome for r in results] == ["passed", "failed", "failed", "crashed", "timed out", "passed"]
    hung = results[4]
    assert [c.name for c in hung.checks] == ["the part before the hang"] and hung.seconds >= hung.budget
    assert sorted(os.listdir(tmp_path)) == ["results.json", "steps.log", "summary.md"]
    summary = (tmp_path / "summary.md").read_text()
    assert "- fails: a wrong sum: AssertionError: 2 + 2 gave 5" in summary
    assert "- raises: acceptance_fakes:raises raised: RuntimeError: the device fell off the bus" in summary
    assert "- dies: crashed: see steps.log" in summary and "- hangs: timed out: see steps.log" in summary
    assert "- fails: a figure: 42 TFLOP/s" in summary  # a noted figure is listed, not judged
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [step["outcome"] for step in saved] == [r.outcome for r in results]
    assert "RuntimeError: the device fell off the bus" in (tmp_path / "steps.log").read_text()


@pytest.mark.system
def test_the_exit_code_is_zero_only_when_every_step_passed(fake_steps, tmp_path):
    from megapipe.acceptance.__main__ import main

    assert main(["--dry-run", "--only", "passes", "--out", str(tmp_path)]) == 0
    assert main(["--dry-run", "--only", "passes,fails", "--out", str(tmp_path)]) == 1


@pytest.mark.unit
def test_an_unknown_step_is_one_sentence(capsys):
    from megapipe.acceptance.__main__ import main

    with pytest.raises(SystemExit):
        main(["--only", "kernels,speed"])
    assert "--only speed: no such step; use some of stack, kernels" in capsys.readouterr().err


@pytest.mark.unit
def test_the_budgets_fit_one_ten_minute_window():
    """Eight minutes of steps on a bare machine leave two of a window for its start and the copy back; the
    steps of a node with several GPUs (``--multi``) fit a window of their own."""
    assert sum(step.budget_seconds for step in STEPS) <= 8 * 60
    assert sum(step.budget_seconds for step in MULTI_STEPS) <= 8 * 60


@pytest.mark.system
def test_a_dry_run_of_the_multi_gpu_steps_passes_on_the_cpu(tmp_path):
    """Every case's flags resolve at 8 ranks, and one case of each dimension (p, t with sequence parallelism,
    c, e, ZeRO-3) matches one process's losses on 4 gloo processes; the timings skip without GPUs."""
    results = runner.run_all(str(tmp_path), dry_run=True, only=[], benchmark_args=[], every=MULTI_STEPS)
    assert [r.outcome for r in results] == ["passed", "passed"], (tmp_path / "summary.md").read_text()
    parity = results[0].checks
    assert sum(c.name.startswith("flags of ") and c.outcome == "passed" for c in parity) == len(multi_parity.cases(8))
    ran = [c.name for c in parity if c.name.endswith("on 4 ranks") and c.outcome == "passed"]
    assert len(ran) == 5, [(c.name, c.outcome, c.detail) for c in parity]
    assert [c.outcome for c in results[1].checks] == ["skipped"]


@pytest.mark.system
def test_a_dry_run_of_the_quick_steps_passes_on_the_cpu(tmp_path):
    results = runner.run_all(str(tmp_path), dry_run=True, only=["stack", "kernels", "attention"], benchmark_args=[])
    assert [r.outcome for r in results] == ["passed"] * 3, (tmp_path / "summary.md").read_text()
    assert sum(c.outcome == "passed" for c in results[1].checks) == 20  # 9 ops and dropout, fp32 and bf16
