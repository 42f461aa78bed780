"""benchmarks/bench_single_device.py: GPT-350M and GPT-1.3B at sequence 2048 in bf16, 8 micro-batches
per optimizer step, megapipe against Hugging Face (and megatron-core where installed), with FP8 rows
and, at GPT-1.3B, a row for each of megapipe's changes turned off. The step fails when a megapipe
system could not run or megapipe and Hugging Face disagree on the maths; a row the device cannot run
(FP8 without FP8 matrix units) is noted with its reason; the performance aims are noted, not enforced."""

from __future__ import annotations

import json
import os
import time

from megapipe.acceptance.record import Context, Record
from megapipe.acceptance.runs import Finished, start

STARTED = time.monotonic()  # the step's process starts with this module

GPU = ["--shape", "gpt-350m,gpt-1.3b", "--ablation-shapes", "gpt-1.3b", "--warmup", "1", "--steps", "2",
       "--rounds", "2"]
DRY = ["--shape", "cpu-small", "--warmup", "1", "--steps", "1", "--rounds", "1", "--micro-batches", "2"]
AIM_MFU, AIM_VS_HF, AIM_350M_MFU = 0.55, 2.0, 0.45  # on one H100, whole step, 8 micro-batches
AIM_FP8_SPEEDUP, AIM_FP8_LOSS = 1.3, 0.01  # FP8 against bf16: tokens/s, relative loss after the same steps
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
    _note_aims(record, report)


def _note_aims(record: Record, report: dict) -> None:
    """The issue's aims, each noted as met or not (never a failure: a GPU's numbers vary)."""
    shapes = {shape: {row["system"]: row for row in rows} for shape, rows in report["shapes"].items()}
    ours = shapes.get("gpt-1.3b", {}).get("megapipe", {})
    if ours.get("mfu") is not None and ours.get("vs_hf") is not None:
        met = ours["mfu"] >= AIM_MFU and ours["vs_hf"] >= AIM_VS_HF
        record.add(f"aim: GPT-1.3B at {AIM_MFU:.0%} MFU or more and {AIM_VS_HF:g}x Hugging Face", "noted",
                   f"{'met' if met else 'not met'}: {ours['mfu']:.1%} MFU (forward and backward "
                   f"{ours['mfu_passes']:.1%}), {ours['vs_hf']:.2f}x Hugging Face")
    small = shapes.get("gpt-350m", {}).get("megapipe", {})
    if small.get("mfu") is not None:
        record.add(f"aim: GPT-350M at {AIM_350M_MFU:.0%} MFU or more", "noted",
                   f"{'met' if small['mfu'] >= AIM_350M_MFU else 'not met'}: {small['mfu']:.1%} MFU")
    for shape, rows in shapes.items():
        for name, row in rows.items():
            if "loss_vs_bf16" in row:
                met = row["vs_bf16"] >= AIM_FP8_SPEEDUP and abs(row["loss_vs_bf16"]) <= AIM_FP8_LOSS
                record.add(f"aim: {shape} {name} at {AIM_FP8_SPEEDUP:g}x bf16's tokens/s, loss within "
                           f"{AIM_FP8_LOSS:.0%}", "noted",
                           f"{'met' if met else 'not met'}: {row['vs_bf16']:.2f}x, loss after the same steps "
                           f"{row['loss_vs_bf16']:+.2%} from bf16's")


def _same_maths(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("same maths check")]
    assert lines, "no same-maths line"
    left_out = [line for line in lines if "left out" in line]
    if left_out:  # no transformers on the machine: megapipe's rows still count, the reference is absent
        return left_out[0].split(": ", 1)[1]
    assert all(line.endswith(": OK") for line in lines), lines[-1]
    return f"{len(lines)} shape(s) OK"


def _ran(row: dict) -> str:
    if "left_out" in row:  # the device cannot run it: megapipe's refusal is the result
        return f"left out: {row['left_out']}"
    assert "error" not in row, row.get("error")
    mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""
    return f"{row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s{mfu}"
