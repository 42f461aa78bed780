"""What ``pretrain_gpt.py``'s training loop adds to the pipeline executor's step.

    python benchmarks/bench_trainer_overhead.py                  # p = 2, 1F1B, m = 8, 12 rounds
    python benchmarks/bench_trainer_overhead.py --rounds 30 --with-torch
    python benchmarks/bench_trainer_overhead.py -- --clip-grad 1.0   # flags after -- go to pretrain_gpt

One world of p processes (gloo, one thread each) builds ``pretrain_gpt.py``'s ``Trainer`` from the
flags of ``bench_pipeline.py``'s model (GPT, 8 layers, hidden 256, 4 heads, sequence 128, a
vocabulary of 1024, no dropout, untied embeddings, fp32, AdamW, no clipping; ``--mock-data``)
with m = 8 microbatches of 2, and next to it ``bench_pipeline.py``'s executor step
(the harness's ``MegapipeRunner``: ``PipelineEngine.train_batch`` on microbatches made beforehand, no timeline)
over a copy of the same model. The first step of both runs on the same microbatches and its
losses must be equal bit for bit (same model, weights and data). Flags after ``--`` change the
trainer's run only (the executor keeps ``bench_pipeline``'s model and optimizer), so a ratio
then says what they cost: ``-- --hidden-dropout 0.1 --attention-dropout 0.1 --clip-grad 1.0``
gives ``pretrain_gpt.py``'s defaults for those.

The trainer's step is one ``Trainer.train_iteration``: reading the batch from the data loader,
the pipeline step, the learning-rate schedule, the loss and skip bookkeeping, the exit check,
and logging, evaluation or saving when their interval comes (by default none does: the log
interval is beyond the run). With ``--with-torch`` PyTorch's ``Schedule1F1B`` over the same stage
modules joins as a third system (``bench_pipeline.TorchRunner``).

The systems take turns step by step, the order rotating every round, each step between two
barriers (a noisy machine slows all alike). Reported: each system's median seconds per step and
CPU seconds per step (all ranks), and per pair of systems the median of the per-round ratios
with the lowest and highest ratio and the quartiles, and the median ratio of CPU time (host
work, which other load inflates less than wall time); and per rank the median time of a
trainer step spent outside ``PipelineEngine.train_batch``, the loop's own work. No thresholds: on
a shared 2-core machine single rounds can be off by tens of percent.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

from bench_pipeline import TorchRunner
from harness import cli, report
from harness.models import MegapipeRunner, adamw, batch
from harness.pairing import take_turns, timed
from harness.ratios import median_ratio, paired, quartiles
from harness.settings import Settings
from megapipe.cli.parse import parse_run
from megapipe.models import build_model_chunks
from megapipe.testing.worlds import run_distributed
from megapipe.training.trainer import Trainer

WARMUP_STEPS = 2  # per system, before timing (lazy optimizer state, first messages)


def trainer_flags(settings: Settings, p: int, rounds: int) -> list[str]:
    """``pretrain_gpt.py`` flags for ``bench_pipeline``'s model, step and optimizer (vocabulary: the
    mock data's ``--vocab-size`` ids plus its end-of-document id)."""
    iterations = WARMUP_STEPS + rounds
    return ["--num-layers", str(settings.num_layers), "--hidden-size", str(settings.hidden_size),
            "--num-attention-heads", str(settings.num_attention_heads), "--seq-length", str(settings.seq_length),
            "--micro-batch-size", str(settings.micro_batch_size),
            "--global-batch-size", str(settings.micro_batch_size * settings.num_microbatches),
            "--mock-data", "--vocab-size", str(settings.vocab_size - 1), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--untie-embeddings-and-output-weights", "--optimizer", "adamw",
            "--lr", "1e-3", "--weight-decay", "0.01", "--clip-grad", "0", "--lr-warmup-iters", "0",
            "--pipeline-model-parallel-size", str(p), "--pipeline-schedule", "1f1b",
            # one iteration more than are run: the last iteration logs, and none of the timed ones may
            "--train-iters", str(iterations + 1), "--log-interval", str(iterations + 1),
            "--eval-interval", str(iterations + 1), "--eval-iters", "1"]


class TrainerStep:
    """One iteration of ``pretrain_gpt.py``'s loop; ``outside`` collects the seconds of each spent
    outside the pipeline step (``PipelineEngine.train_batch``): the loop's own work."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.batches = trainer, trainer.train_batches()
        self.outside: list[float] = []

    def __call__(self) -> None:
        engine, start = self.trainer.engine, time.perf_counter()
        train_batch, inside = engine.train_batch, []

        def timed(microbatches):
            begin = time.perf_counter()
            result = train_batch(microbatches)
            inside.append(time.perf_counter() - begin)
            return result

        engine.train_batch = timed
        try:
            reason = self.trainer.train_iteration(self.batches)
        finally:
            del engine.train_batch  # the method again
        self.outside.append(time.perf_counter() - start - sum(inside))
        assert reason is None, reason


class RunnerStep:
    """One step of a ``bench_pipeline`` runner on the next of the batches made beforehand."""

    def __init__(self, runner, steps: list):
        self.runner, self.steps, self.done = runner, steps, 0

    def __call__(self) -> None:
        self.runner.step(*self.steps[self.done])
        self.done += 1


def bench_model(trainer: Trainer, settings: Settings) -> list:
    """This rank's chunks of ``bench_pipeline``'s model, with the trainer's weights when its flags
    built the same model (flags after -- may change it: dropout, say)."""
    chunks = build_model_chunks("gpt", settings.model_config(), trainer.ps)
    if same_model(trainer, settings):
        for mine, theirs in zip(trainer.chunks, chunks):
            theirs.load_state_dict(mine.state_dict())
    return chunks


def same_model(trainer: Trainer, settings: Settings) -> bool:
    return dataclasses.asdict(trainer.config.model) == dataclasses.asdict(settings.model_config())


def world(rank: int, world_size: int, settings: Settings, rounds: int, extra: list[str],
          with_torch: bool) -> dict:
    plan = parse_run("gpt", trainer_flags(settings, world_size, rounds) + extra, world_size=world_size)
    trainer = Trainer(plan)
    executor = MegapipeRunner(bench_model(trainer, settings), trainer.ps, settings, "1f1b", adamw())
    steps = [batch(settings, step) for step in range(WARMUP_STEPS + rounds)]  # made before any timing
    systems = {"pretrain_gpt": TrainerStep(trainer), "executor": RunnerStep(executor, steps)}
    if with_torch:
        torch_runner = TorchRunner(bench_model(trainer, settings), trainer.ps, settings, "1f1b")
        systems["torch Schedule1F1B"] = RunnerStep(torch_runner, steps)
    check = None
    if same_model(trainer, settings):  # the same model, weights and microbatches give the same losses, bit for bit
        first = next(trainer.batches.batches("train"))
        check = [trainer.engine.train_batch(first).losses, executor.engine.train_batch(first).losses]
    names = list(systems)
    for name in names:
        for _ in range(WARMUP_STEPS):
            timed(systems[name])
    systems["pretrain_gpt"].outside.clear()
    turns = take_turns(names, rounds, lambda name, _: timed(systems[name]))
    wall, cpu = ({name: [t[k] for t in turns[name]] for name in names} for k in range(2))
    return {"wall": wall, "cpu": cpu, "outside": systems["pretrain_gpt"].outside,
            "check": check if trainer.ps.is_last_stage else None,
            "same_model": same_model(trainer, settings)}


def ratio_row(wall: dict, cpu: dict, a: str, b: str) -> str:
    """Wall-time ratios of the pairs (median, quartiles, range) and the median CPU-time ratio."""
    ratios = sorted(paired(wall[a], wall[b]))
    low, median, high = quartiles(ratios)
    return report.markdown_row([f"{a} / {b}", f"**{median:.3f}**", f"{low:.3f}-{high:.3f}",
                                f"{ratios[0]:.3f}-{ratios[-1]:.3f}", f"{median_ratio(cpu[a], cpu[b]):.3f}",
                                len(ratios)])


def main(argv=None) -> int:
    parser = cli.parser(__doc__, rounds=12, rounds_help="timed steps per system (default 12)")
    parser.add_argument("--pipeline-size", type=int, default=2)
    parser.add_argument("--with-torch", action="store_true", help="also time PyTorch's Schedule1F1B")
    parser.add_argument("extra", nargs="*", help="after --: more pretrain_gpt.py flags (they override)")
    args = parser.parse_args(argv)
    settings = Settings()
    print(f"model: {settings.describe_model()}; {settings.num_microbatches} microbatches of "
          f"{settings.micro_batch_size}; 1F1B at p = {args.pipeline_size}; gloo, one thread per rank")
    print(f"pretrain_gpt.py flags: {' '.join(trainer_flags(settings, args.pipeline_size, args.rounds) + args.extra)}")
    print(f"machine: {report.machine()}")
    results = run_distributed(args.pipeline_size, world, settings, args.rounds, args.extra, args.with_torch,
                              timeout=3600, collective_timeout=600)
    wall = results[0]["wall"]  # every step ends in a barrier: all ranks see the same times
    names = list(wall)
    cpu = {name: [sum(r["cpu"][name][i] for r in results) for i in range(args.rounds)] for name in names}
    report.print_markdown(["system", "median s/step", "CPU s/step, all ranks"],
                          ([name, f"{statistics.median(wall[name]):.4f}", f"{statistics.median(cpu[name]):.3f}"]
                           for name in names))
    report.print_markdown(["ratio", "median of pairs", "quartiles", "lowest-highest", "CPU time, median of pairs",
                           "pairs"], [])
    for other in names[1:]:
        print(ratio_row(wall, cpu, "pretrain_gpt", other))
    if "torch Schedule1F1B" in names:
        print(ratio_row(wall, cpu, "executor", "torch Schedule1F1B"))
    outside = ", ".join(f"rank {rank} {1e3 * statistics.median(r['outside']):.2f}" for rank, r in enumerate(results))
    print(f"\npretrain_gpt's own work per step, outside PipelineEngine.train_batch (median ms): {outside}")
    print(f"load average at the end: {report.load_average()}")
    if not results[0]["same_model"]:
        print("the flags after -- change the model: the executor runs bench_pipeline's model, no loss comparison")
        return 0
    trainer_losses, executor_losses = next(r["check"] for r in results if r["check"] is not None)
    if trainer_losses != executor_losses:
        print(f"FAILED: the first step's losses differ: pretrain_gpt {trainer_losses}, executor {executor_losses}")
        return 1
    print(f"the first step's {len(trainer_losses)} losses are equal bit for bit (same model, weights and data)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
