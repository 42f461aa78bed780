"""Host synchronisations of whole training iterations (``Trainer.count_synchronisations``: CUDA's
sync debug mode on a GPU, every host read of a tensor on the CPU) outside log intervals: none, for a
flush schedule and PipeDream-2BW at m = 2 and m = 8, in bf16 with gradient clipping."""

from __future__ import annotations

from megapipe.acceptance.record import Context, Record
from megapipe.acceptance.runs import CPU_MODEL, GPU_MODEL
from megapipe.cli.parse import parse_run
from megapipe.schedules.catalog import one_f_one_b, two_bw
from megapipe.training.trainer import Trainer

COUNTED = 3
FLAGS = ["--mock-data", "--vocab-size", "1024", "--train-iters", "100", "--log-interval", "100",
         "--eval-interval", "100", "--eval-iters", "1", "--untie-embeddings-and-output-weights", "--bf16"]
CASES = tuple((schedule, m) for schedule in (one_f_one_b.DESCRIPTOR.name, two_bw.DESCRIPTOR.name) for m in (2, 8))


def count(flags: list[str]) -> str:
    trainer = Trainer(parse_run("gpt", flags, world_size=1))
    try:
        found = trainer.count_synchronisations(COUNTED)
    finally:
        trainer.engine.drain()
        trainer.exit_conditions.close()
    assert found == 0, f"{found} in {COUNTED} iterations"
    return f"0 in {COUNTED} iterations"


def run(record: Record, context: Context) -> None:
    model = (CPU_MODEL if context.dry_run else GPU_MODEL) + ["--micro-batch-size", "1"]  # the last value counts
    for schedule, m in CASES:
        flags = FLAGS + model + ["--pipeline-schedule", schedule, "--global-batch-size", str(m)]
        record.check(f"{schedule}, m = {m}", lambda: count(flags))
