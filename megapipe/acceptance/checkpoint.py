"""A run saved with --async-save and resumed with --load continues exactly as if it never stopped.

fp32 without dropout: the resumed iterations repeat the uninterrupted run's kernels on the same
values, so their losses agree to fp32 rounding of sums whose order the GPU may vary between runs
(atomics in some backward kernels): 1e-5 relative bounds that and catches any state not restored
(optimizer moments, the learning-rate schedule, the data position), which moves a loss by far more.
"""

from __future__ import annotations

import os

from megapipe.acceptance.record import Context, Record
from megapipe.acceptance.runs import Finished, model_flags, run_together, start

ITERATIONS, STOP_AT, RTOL = 6, 3, 1e-5


def run(record: Record, context: Context) -> None:
    save = os.path.join(context.work, "checkpoint")
    common = model_flags(context) + ["--train-iters", str(ITERATIONS), "--lr-decay-iters", str(ITERATIONS)]
    first = run_together({
        "uninterrupted run": ("pretrain_gpt.py", common),
        f"run saved at iteration {STOP_AT} (--async-save)": (
            "pretrain_gpt.py", common + ["--save", save, "--async-save", "--exit-interval", str(STOP_AT)]),
    })
    whole, saved = first.values()
    if not (record.check(whole.what, whole.succeeded) and record.check(saved.what, saved.succeeded)):
        return
    resumed = Finished("resumed run (--load)", start("pretrain_gpt.py", common + ["--load", save]))
    record.check("resumed losses equal the uninterrupted run's", lambda: _same_tail(resumed, whole.losses()))


def _same_tail(resumed: Finished, expected: dict) -> str:
    resumed.succeeded()
    got = resumed.losses()
    assert sorted(got) == list(range(STOP_AT + 1, ITERATIONS + 1)), f"resumed iterations {sorted(got)}"
    worst = max(abs(got[i] - expected[i]) / abs(expected[i]) for i in got)
    assert worst <= RTOL, ", ".join(f"{i}: {got[i]:.7f} vs {expected[i]:.7f}" for i in got)
    return f"iterations {STOP_AT + 1}-{ITERATIONS} within {worst:.1e} relative"
