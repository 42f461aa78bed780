"""Runs the acceptance steps in order, each in a child process with its deadline, and writes the
summary (``summary.md``), every step's output (``steps.log``) and the checks (``results.json``)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from megapipe.acceptance import STEPS, Step
from megapipe.acceptance.record import Check, read_checks
from megapipe.atomic_files import write_atomically

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRY_RUN_SCALE = 4  # the CPU runs the small shapes of a dry run about this much slower than a GPU the real ones


@dataclass
class StepResult:
    step: Step
    outcome: str  # passed, failed, timed out, crashed
    seconds: float
    budget: float
    checks: list[Check] = field(default_factory=list)

    def counts(self) -> str:
        tally = {kind: sum(c.outcome == kind for c in self.checks) for kind in ("passed", "failed", "skipped", "noted")}
        return ", ".join(f"{n} {kind}" for kind, n in tally.items() if n) or "no checks"


def child_environment(work: str, dry_run: bool) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1",
               MEGAPIPE_CACHE=os.path.join(work, "cache"))
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if dry_run:
        env["MEGAPIPE_DEVICE"] = "cpu"
    else:
        env.pop("MEGAPIPE_DEVICE", None)
    return env


def run_step(step: Step, budget: float, work: str, log, dry_run: bool, benchmark_args: list[str]) -> StepResult:
    """Run ``step`` in its own process group, killed (with everything it started) at ``budget`` seconds."""
    record = os.path.join(work, f"{step.name}.jsonl")
    step_work = os.path.join(work, step.name)
    os.makedirs(step_work, exist_ok=True)
    command = [sys.executable, "-m", "megapipe.acceptance.step", step.module, "--record", record, "--work", step_work]
    command += (["--dry-run"] if dry_run else []) + [f"--benchmark-arg={arg}" for arg in benchmark_args]
    command += [f"--budget={budget:.0f}"]
    log.write(f"\n===== {step.name} (budget {budget:.0f} s): {step.what}\n")
    log.flush()
    started = time.monotonic()
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                             env=child_environment(work, dry_run))
    try:
        code = child.wait(timeout=budget)
        outcome = "crashed" if code not in (0, 1) else None
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        outcome = "timed out"
    seconds = time.monotonic() - started
    checks = read_checks(record)
    if outcome is None:
        outcome = "failed" if code != 0 or any(c.outcome == "failed" for c in checks) else "passed"
    log.write(f"===== {step.name}: {outcome} in {seconds:.0f} s\n")
    log.flush()
    return StepResult(step, outcome, seconds, budget, checks)


def stack_line(results: list[StepResult]) -> str:
    stack = next((r for r in results if r.step.name == "stack"), None)
    return "; ".join(c.detail for c in (stack.checks if stack else []) if c.name in ("software", "device"))


def benchmark_table(results: list[StepResult]) -> list[str]:
    bench = next((r for r in results if r.step.name == "benchmark"), None)
    report = next((c.values.get("report") for c in (bench.checks if bench else []) if c.values.get("report")), None)
    if not report:
        return ["No benchmark result."]
    lines = [f"{report.get('micro_batches', '?')} micro-batches per step; MFU f+b: forward and backward passes, "
             "MFU: the whole step; vs HF: Hugging Face's step time / this one's.", "",
             "| model | system | ms/step | tokens/s | MFU f+b | MFU | vs HF | peak GiB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def number(value, form):
        return "-" if value is None else format(value, form)

    for shape, rows in report.get("shapes", {}).items():
        for row in rows:
            if "error" in row or "left_out" in row:
                reason = f"not run: {row['error']}" if "error" in row else f"left out: {row['left_out']}"
                lines.append(f"| {shape} | {row['system']} | {reason} | | | | | |")
                continue
            lines.append(f"| {shape} | {row['system']} | {row['ms_per_step']:.1f} | {row['tokens_per_s']:.0f} | "
                         f"{number(row['mfu_passes'], '.1%')} | {number(row['mfu'], '.1%')} | "
                         f"{number(row['vs_hf'], '.2f')} | {number(row['peak_gib'], '.1f')} |")
    fp8 = [(shape, row) for shape, rows in report.get("shapes", {}).items() for row in rows if "loss_vs_bf16" in row]
    if fp8:
        lines += [""] + [f"- {shape}, {row['system']}: {row['vs_bf16']:.2f}x bf16's tokens/s, loss after the same "
                         f"steps {row['loss_vs_bf16']:+.2%} from bf16's" for shape, row in fp8]
    return lines


def write_summary(out: str, results: list[StepResult], dry_run: bool, total_seconds: float) -> str:
    """The one-page summary as Markdown (also written to ``out/summary.md``)."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# megapipe GPU acceptance{' (dry run on the CPU)' if dry_run else ''}, {when}", "",
             stack_line(results), "",
             f"Total {total_seconds:.0f} s of {sum(r.budget for r in results):.0f} s budgeted.", "",
             "| step | outcome | seconds (budget) | checks |", "| --- | --- | ---: | --- |"]
    lines += [f"| {r.step.name} | {r.outcome} | {r.seconds:.0f} ({r.budget:.0f}) | {r.counts()} |" for r in results]
    failures = [(r.step.name, c) for r in results for c in r.checks if c.outcome == "failed"]
    failures += [(r.step.name, Check(r.outcome, r.outcome, "see steps.log")) for r in results
                 if r.outcome in ("timed out", "crashed")]
    if failures:
        lines += ["", "## Failures", ""] + [f"- {step}: {c.name}: {c.detail}" for step, c in failures]
    for outcome, title in (("skipped", "Skipped"), ("noted", "Notes")):
        listed = [(r.step.name, c) for r in results for c in r.checks if c.outcome == outcome]
        if listed:
            lines += ["", f"## {title}", ""] + [f"- {step}: {c.name}: {c.detail}" for step, c in listed]
    if any(r.step.name == "benchmark" for r in results):
        lines += ["", "## Single-device benchmark", ""] + benchmark_table(results)
    text = "\n".join(lines) + "\n"
    write_atomically(os.path.join(out, "summary.md"), text)
    return text


def run_all(out: str, dry_run: bool, only: list[str], benchmark_args: list[str],
            every: Optional[tuple[Step, ...]] = None) -> list[StepResult]:
    """Run the steps of ``every`` (one GPU's ``STEPS`` by default, or ``MULTI_STEPS``) that ``only`` names
    (all when empty), within the sum of their budgets."""
    every = STEPS if every is None else every
    steps = [step for step in every if not only or step.name in only]
    total = sum(step.budget_seconds for step in every)
    scale = DRY_RUN_SCALE if dry_run else 1
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="megapipe-acceptance-")
    results, started = [], time.monotonic()
    try:
        with open(os.path.join(out, "steps.log"), "w") as log:
            for step in steps:
                left = total * scale - (time.monotonic() - started)
                budget = max(min(step.budget_seconds * scale, left), 1.0)
                result = run_step(step, budget, work, log, dry_run, benchmark_args)
                results.append(result)
                print(f"{step.name:11s} {result.outcome:9s} {result.seconds:4.0f} s of {budget:.0f}: "
                      f"{result.counts()}", flush=True)
        write_atomically(os.path.join(out, "results.json"), json.dumps(
            [{"step": r.step.name, "outcome": r.outcome, "seconds": r.seconds, "budget": r.budget,
              "checks": [asdict(c) for c in r.checks]} for r in results], indent=1))
        print(write_summary(out, results, dry_run, time.monotonic() - started))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results
