"""tools/generate.py on the device from a checkpoint: greedy, and sampled with temperature, top-k,
top-p and a repetition penalty; each repeatable (the same tokens twice) for a seed."""

from __future__ import annotations

import os

from megapipe.acceptance.record import Context, Record
from megapipe.acceptance.runs import Finished, model_flags, run_together, start

PROMPTS = ["--prompt-ids", "1 2 3 4", "--prompt-ids", "5 6"]
NEW_TOKENS = 8
SAMPLED = ["--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--repetition-penalty", "1.3", "--seed", "7"]


def run(record: Record, context: Context) -> None:
    save = os.path.join(context.work, "checkpoint")
    trained = Finished("training a checkpoint", start("pretrain_gpt.py", model_flags(context) + [
        "--train-iters", "2", "--save", save]))
    if not record.check(trained.what, trained.succeeded):
        return
    common = ["--load", save, "--max-new-tokens", str(NEW_TOKENS)] + PROMPTS
    runs = run_together({f"{mode} {n}": ("tools/generate.py", common + flags)
                         for mode, flags in (("greedy", ["--greedy"]), ("sampled", SAMPLED)) for n in (1, 2)})
    for mode in ("greedy", "sampled"):
        record.check(f"{mode}, repeatable", lambda: _same_twice(runs[f"{mode} 1"], runs[f"{mode} 2"]))


def _same_twice(first: Finished, second: Finished) -> str:
    first.succeeded()
    second.succeeded()
    lines = first.stdout.strip().splitlines()
    assert [len(line.split()) for line in lines] == [4 + NEW_TOKENS, 2 + NEW_TOKENS], f"output: {lines}"
    assert first.stdout == second.stdout, f"two runs differ: {lines} vs {second.stdout.strip().splitlines()}"
    return " / ".join(lines)
