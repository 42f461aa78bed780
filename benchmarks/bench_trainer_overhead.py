"""Where ``pretrain_gpt.py``'s step goes, against the pipeline executor's and PyTorch's ``Schedule1F1B``.

    python benchmarks/bench_trainer_overhead.py                         # p = 2, 1F1B, 8 rounds
    python benchmarks/bench_trainer_overhead.py --schedules 1f1b,zbv,interleaved-zb,auto:2 --rounds 10
    python benchmarks/bench_trainer_overhead.py --pipeline-size 4 -- --num-layers 16   # flags after -- go to pretrain_gpt

One world of p processes (gloo, one thread each) builds ``pretrain_gpt.py``'s ``Trainer`` from the
command line a user types (``user_flags``: GPT, 8 layers, hidden 256, 4 heads, sequence 128, 8
microbatches of 2, dropout off, a log line every iteration, everything else the command line's
default: the embedded corpus and its byte-level vocabulary, tied embeddings, clipping at 1.0, AdamW,
the LR schedule). Next to it, taking turns step by step in one run:

* ``executor, same model``: a twin ``Trainer`` of the same flags whose ``PipelineEngine.train_batch``
  runs on microbatches read beforehand: the same model, weights, optimizer and clipping, without the
  loop (data loading, the LR step, loss bookkeeping, logging). Its first step's losses must equal
  the trainer's bit for bit.
* one ``Trainer`` per further ``--schedules`` entry (zero-bubble schedules, say; the V and
  interleaved ones get the fewest chunks they take), same flags otherwise.
* ``bench_pipeline``'s executor and PyTorch's ``Schedule1F1B`` (``bench_pipeline.TorchRunner``) on
  ``bench_pipeline``'s model (vocabulary 1024, untied, no clipping, AdamW): what users compare with.

The systems take turns step by step, the order rotating every round, each step between two
barriers (a noisy machine slows all alike). Reported: each system's median seconds per step and
the median of its per-round ratios to ``torch Schedule1F1B`` (quartiles, range) and to the trainer;
and per rank where the trainer's step goes (``BREAKDOWN``: data, passes and bubble, gradient
finalisation, optimizer, LR, log line, the loop's rest), each part timed where it is called, in
median ms per step. No thresholds: on a shared 2-core machine single rounds can be off by tens of
percent.
"""

from __future__ import annotations

import collections
import functools
import statistics
import sys
import time
from typing import Callable, Optional

from bench_pipeline import TorchRunner
from harness import cli, report
from harness.models import MegapipeRunner, adamw, batch
from harness.pairing import take_turns, timed
from harness.ratios import paired, quartiles
from harness.settings import Settings
from megapipe.cli.parse import parse_run
from megapipe.models import build_model_chunks
from megapipe.pipeline import engine as engine_module
from megapipe.schedules.catalog import schedule_descriptor
from megapipe.testing.worlds import run_distributed
from megapipe.training.trainer import Trainer

WARMUP_STEPS = 2  # per system, before timing (lazy optimizer state, first messages)
TRAINER = "pretrain_gpt"
TWIN = "executor, same model"
TORCH = "torch Schedule1F1B"
BENCH_EXECUTOR = "executor, bench_pipeline's model"


def user_flags(p: int, schedule: str, iterations: int) -> list[str]:
    """The command line a user runs (the issue's), for ``iterations`` iterations and one more: the
    run's last iteration would end it, and none of the timed ones may."""
    return ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--train-iters", str(iterations + 1), "--log-interval", "1", "--eval-iters", "0",
            "--pipeline-model-parallel-size", str(p), "--pipeline-schedule", schedule.partition(":")[0], *chunk_flags(p, schedule)]


def chunk_flags(p: int, schedule: str) -> list[str]:
    """``NAME:v`` runs v model chunks per rank; a schedule of several gets the fewest it takes (two of
    8 / 2p layers for a V)."""
    name, _, given = schedule.partition(":")
    chunks = int(given) if given else schedule_descriptor(name).sizes.least_chunks
    return [] if chunks == 1 else ["--num-layers-per-virtual-pipeline-stage", str(8 // (chunks * p))]


class PhaseClock:
    """Seconds of named parts of one trainer's steps, timed where they are called; only calls inside
    ``step`` count, one record per step (``WHOLE``: the step itself)."""

    def __init__(self):
        self.records: list[dict[str, float]] = []
        self._current: Optional[dict[str, float]] = None

    def timed(self, phase: str, call: Callable, *args, **kwargs):
        if self._current is None:
            return call(*args, **kwargs)
        begin = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self._current[phase] = self._current.get(phase, 0.0) + time.perf_counter() - begin

    def wrap(self, owner, name: str, phase: str) -> None:
        """Time ``owner.name`` (a method of one object, or a function its module calls by name) as ``phase``."""
        setattr(owner, name, functools.partial(self.timed, phase, getattr(owner, name)))

    def step(self, run: Callable[[], object]) -> None:
        self._current = {}
        try:
            self.timed(WHOLE, run)
        finally:
            self.records.append(self._current)
            self._current = None

    def breakdown_ms(self) -> dict[str, float]:
        """Median milliseconds per step of each part of ``BREAKDOWN``."""
        return {part: 1e3 * statistics.median(value(collections.Counter(r)) for r in self.records)
                for part, value in BREAKDOWN.items()}


WHOLE, DATA, PIPELINE, STEP, FINALIZE, OPTIMIZER, LR, LOG = (
    "step", "data", "train_batch", "STEP", "finalize", "optimizer", "lr", "log")
BREAKDOWN = {  # the parts of a trainer's step, from the phases timed (``clocked``)
    "data loading and batch building": lambda r: r[DATA],
    "forward and backward passes, their messages, the bubble": lambda r: r[PIPELINE] - r[STEP],
    "gradient finalisation: the tied embedding's all-reduce (waits for the other end)": lambda r: r[FINALIZE],
    "optimizer: gradient norm and its all-reduce, clipping, AdamW": lambda r: r[OPTIMIZER],
    "after the update: gradients zeroed": lambda r: r[STEP] - r[FINALIZE] - r[OPTIMIZER],
    "learning-rate schedule": lambda r: r[LR],
    "log line: losses read and averaged, timing, printing": lambda r: r[LOG],
    "rest of the loop: loss bookkeeping, counters, exit check": lambda r: r[WHOLE] - r[DATA] - r[PIPELINE] - r[LR]
    - r[LOG],
    "whole step": lambda r: r[WHOLE],
}


def clocked(trainer: Trainer, clock: PhaseClock) -> "TrainerStep":
    """The trainer's step with its parts (``BREAKDOWN``) on ``clock``."""
    engine = trainer.engine
    clock.wrap(engine, "train_batch", PIPELINE)
    clock.wrap(engine.executor, "step", STEP)
    clock.wrap(engine_module, "finalize_model_grads", FINALIZE)
    clock.wrap(engine.optimizer, "step", OPTIMIZER)
    clock.wrap(trainer.scheduler, "step", LR)
    clock.wrap(trainer, "_log", LOG)
    step = TrainerStep(trainer, clock)
    batches = step.batches
    step.batches = iter(lambda: clock.timed(DATA, next, batches), None)
    return step


class TrainerStep:
    """One iteration of ``pretrain_gpt.py``'s loop (``Trainer.train_iteration``)."""

    def __init__(self, trainer: Trainer, clock: Optional[PhaseClock] = None):
        self.trainer, self.batches, self.clock = trainer, trainer.train_batches(), clock

    def __call__(self) -> None:
        reasons = []
        run = lambda: reasons.append(self.trainer.train_iteration(self.batches))  # noqa: E731
        if self.clock is None:
            run()
        else:
            self.clock.step(run)
        assert reasons[0] is None, reasons[0]


class EngineStep:
    """One ``train_batch`` of an engine on the next of the microbatch lists made beforehand."""

    def __init__(self, engine, steps: list):
        self.engine, self.steps, self.done = engine, steps, 0

    def __call__(self) -> list:
        result = self.engine.train_batch(self.steps[self.done])
        self.done += 1
        return result.losses


class RunnerStep:
    """One step of a ``bench_pipeline`` runner on the next of the batches made beforehand."""

    def __init__(self, runner, steps: list):
        self.runner, self.steps, self.done = runner, steps, 0

    def __call__(self) -> None:
        self.runner.step(*self.steps[self.done])
        self.done += 1


def world(rank: int, world_size: int, settings: Settings, rounds: int, schedules: list[str], extra: list[str]) -> dict:
    iterations = WARMUP_STEPS + rounds

    def trainer(schedule: str) -> Trainer:
        return Trainer(parse_run("gpt", user_flags(world_size, schedule, iterations) + extra, world_size=world_size))

    main = trainer(schedules[0])
    twin = trainer(schedules[0])
    twin_batches = twin.train_batches()
    premade = [next(twin_batches) for _ in range(iterations)]  # read before any timing
    first_losses = [main.engine.train_batch(premade[0]).losses, EngineStep(twin.engine, premade)()]
    clock = PhaseClock()
    systems = {TRAINER: clocked(main, clock), TWIN: EngineStep(twin.engine, premade[1:])}
    for schedule in schedules[1:]:
        systems[f"{TRAINER} --pipeline-schedule {schedule}"] = TrainerStep(trainer(schedule))
    steps = [batch(settings, step) for step in range(iterations)]
    bench_chunks = [build_model_chunks("gpt", settings.model_config(), main.ps) for _ in range(2)]
    systems[BENCH_EXECUTOR] = RunnerStep(MegapipeRunner(bench_chunks[0], main.ps, settings, "1f1b", adamw()), steps)
    systems[TORCH] = RunnerStep(TorchRunner(bench_chunks[1], main.ps, settings, "1f1b"), steps)
    names = list(systems)
    for name in names:
        for _ in range(WARMUP_STEPS - (name == TWIN)):  # the twin's first step was the loss check's
            timed(systems[name])
    clock.records.clear()
    turns = take_turns(names, rounds, lambda name, _: timed(systems[name]))
    return {"wall": {name: [t[0] for t in turns[name]] for name in names}, "breakdown": clock.breakdown_ms(),
            "check": first_losses if main.ps.is_last_stage else None}


def ratio_cells(wall: dict, a: str, b: str) -> list[str]:
    """The median of the per-round ratios ``a / b`` with their quartiles and range."""
    ratios = sorted(paired(wall[a], wall[b]))
    low, median, high = quartiles(ratios)
    return [f"**{median:.3f}**", f"{low:.3f}-{high:.3f}", f"{ratios[0]:.3f}-{ratios[-1]:.3f}"]


def main(argv=None) -> int:
    parser = cli.parser(__doc__, rounds=8, rounds_help="timed steps per system (default 8)")
    parser.add_argument("--pipeline-size", type=int, default=2)
    parser.add_argument("--schedules", default="1f1b",
                        help="comma-separated --pipeline-schedule values, each a trainer (NAME:v for v chunks per "
                             "rank; the first gets the breakdown; default 1f1b)")
    parser.add_argument("extra", nargs="*", help="after --: more pretrain_gpt.py flags for every trainer")
    args = parser.parse_args(argv)
    settings, schedules = Settings(), args.schedules.split(",")
    flags = user_flags(args.pipeline_size, schedules[0], WARMUP_STEPS + args.rounds) + args.extra
    print(f"pretrain_gpt.py {' '.join(flags)}")
    print(f"against: {settings.describe_model()}; {settings.num_microbatches} microbatches of "
          f"{settings.micro_batch_size}; PyTorch's Schedule1F1B at p = {args.pipeline_size}; gloo, one thread per rank")
    print(f"machine: {report.machine()}")
    results = run_distributed(args.pipeline_size, world, settings, args.rounds, schedules, args.extra,
                              timeout=3600, collective_timeout=600)
    wall = results[0]["wall"]  # every step ends in a barrier: all ranks see the same times
    report.print_markdown(["system", "median s/step", f"/ {TORCH}: median of pairs", "quartiles", "lowest-highest",
                           f"/ {TRAINER}: median of pairs"],
                          ([name, f"{statistics.median(wall[name]):.4f}", *ratio_cells(wall, name, TORCH),
                            f"{statistics.median(paired(wall[name], wall[TRAINER])):.3f}"] for name in wall))
    report.print_markdown([f"part of {TRAINER}'s step, median ms", *(f"rank {r}" for r in range(len(results)))],
                          ([part, *(f"{r['breakdown'][part]:.1f}" for r in results)] for part in BREAKDOWN))
    print(f"load average at the end: {report.load_average()}")
    trainer_losses, twin_losses = next(r["check"] for r in results if r["check"] is not None)
    if trainer_losses != twin_losses:
        print(f"FAILED: the first step's losses differ: {TRAINER} {trainer_losses}, {TWIN} {twin_losses}")
        return 1
    print(f"the first step's {len(trainer_losses)} losses of {TRAINER} and {TWIN} are equal bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
