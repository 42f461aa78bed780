"""benchmarks/bench_single_device.py: GPT-350M and GPT-1.3B at sequence 2048 in bf16, 8 micro-batches
per optimizer step, megapipe against Hugging Face (and megatron-core where installed). The step
fails when a megapipe system could not run or megapipe and Hugging Face disagree on the maths; the
performance aims are noted, not enforced."""

from __future__ import annotations

import json
import os
import time

from megapipe.acceptance.record import Context, Record
from megapipe.acceptance.runs import Finished, start

STARTED = time.monotonic()  # the step's process starts with this module

GPU = ["--shape", "gpt-350m,gpt-1.3b", "--warmup", "1", "--steps", "2", "--rounds", "2"]
DRY = ["--shape", "cpu-small", "--warmup", "1", "--steps", "1", "--rounds", "1", "--micro-batches", "2"]
AIM_MFU, AIM_VS_HF = 0.55, 1.5  # GPT-1.3B on one H100, whole step, 8 micro-batches
MARGIN_SECONDS = 10  # to read what the benchmark wrote before the runner stops the step (and this process's start)


def run(record: Record, context: Context) -> None:
    report_path = os.path.join(context.work, "bench.json")
    args = (DRY if context.dry_run else GPU) + list(context.benchmark_args) + ["--json", report_path]
    left = context.budget_seconds - (time.monotonic() - STARTED) - MARGIN_SECONDS
    deadline = left if left != float("inf") else None
    result = Finished("bench_single_device.py", start("benchmarks/bench_single_device.py", args), deadline)
    record.check("benchmark ran", result.succeeded)
    if not os.path.exists(report_path):
        return
    with open(report_path) as f:  # every system finished so far, also when the deadline cut the rest
        report = json.load(f)
    record.add("report", "passed", f"{len(report['shapes'])} shape(s) on {report['device']}", report=report)
    record.check("megapipe and Hugging Face compute the same maths", lambda: _same_maths(result.stdout))
    for shape, rows in report["shapes"].items():
        for row in rows:
            if row["system"].startswith("megapipe"):
                record.check(f"{shape}: {row['system']}", lambda: _ran(row))
    rows = {row["system"]: row for row in report["shapes"].get("gpt-1.3b", [])}
    ours = rows.get("megapipe", {})
    if ours.get("mfu") is not None and ours.get("vs_hf") is not None:
        met = ours["mfu"] >= AIM_MFU and ours["vs_hf"] >= AIM_VS_HF
        record.add("aim: GPT-1.3B at 55% MFU or more and 1.5x Hugging Face", "noted",
                   f"{'met' if met else 'not met'}: {ours['mfu']:.1%} MFU (forward and backward "
                   f"{ours['mfu_passes']:.1%}), {ours['vs_hf']:.2f}x Hugging Face")


def _same_maths(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("same maths check")]
    assert lines, "no same-maths line"
    assert all(line.endswith(": OK") for line in lines), lines[-1]
    return f"{len(lines)} shape(s) OK"


def _ran(row: dict) -> str:
    assert "error" not in row, row.get("error")
    mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""
    return f"{row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s{mfu}"
