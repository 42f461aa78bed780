"""PipeDream and PipeDream-2BW against PipeDream-Flush (1F1B): time per microbatch in steady
state, measured on this machine's CPU, next to the simulator's prediction.

    python benchmarks/bench_async_schedules.py            # p = 2, m = 2 and 4; ~3 min on an idle 2-core machine
    python benchmarks/bench_async_schedules.py --quick    # 2 rounds of 2 timed batches, a smoke test

One world of p processes (gloo, one thread each) holds one GPT per schedule, all from the
same weights, fed the same microbatches. Rounds rotate the schedules' order so that a noisy
machine slows each alike. In a round every schedule runs a block: the flush schedule K
batches; PipeDream and 2BW first fill their pipeline (their warm-up batches), then K timed
batches, then drain, so that nothing is in flight when the next schedule's block starts.
The K timed batches sit between two barriers; time per microbatch = their wall time / (K m).
Reported: its median over rounds, and the median over rounds of the ratio to the flush
block of the same round (neighbouring blocks see about the same machine load).

The prediction simulates each schedule with the costs measured on the same timed batches:
per stage, the mean forward and backward time; per schedule, the mean optimizer step (STEP
or UPDATE). For the flush schedule it is one batch's simulated time / m; for the
asynchronous ones the steady-state time per microbatch of their unrolled form (the growth of
its simulated time from 6 to 8 batches, over 2m). With unit costs the flush bubble is
(p-1)/(m+p-1) and the asynchronous schedules have none.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness import cli, report
from harness.models import step_microbatches
from harness.pairing import take_turns
from harness.ratios import median_ratio
from harness.settings import Settings
from megapipe.models import build_model_chunks
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.schedules.analysis.timeline import Timeline
from megapipe.schedules.catalog import build_schedule
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

SCHEDULES = ("1f1b", "pipedream", "2bw")
LAYERS_PER_STAGE = 2


@dataclass(frozen=True)
class AsyncSettings(Settings):
    p: int = 2
    num_microbatches: int = 2
    rounds: int = 7
    timed_batches: int = 4
    num_layers: int = LAYERS_PER_STAGE * 2
    vocab_size: int = 512
    micro_batch_size: int = 4

    @classmethod
    def of(cls, p: int, m: int, quick: bool) -> "AsyncSettings":
        return cls(p=p, num_microbatches=m, num_layers=LAYERS_PER_STAGE * p, rounds=2 if quick else 7,
                   timed_batches=2 if quick else 4)


class Runner:
    """One schedule's engine on this rank, with the timeline of its timed batches."""

    def __init__(self, settings: AsyncSettings, ps: ParallelState, schedule: str):
        config = settings.model_config()
        self.settings, self.schedule = settings, schedule
        chunks = build_model_chunks("gpt", config, ps, seed=1234)
        self.timeline = Timeline()
        self.engine = PipelineEngine(chunks, ps, OptimizerConfig(optimizer="adamw", lr=1e-4), schedule,
                                     settings.num_microbatches, settings.activation_shape, timeline=self.timeline)
        self.batch = 0

    def block(self) -> float:
        """Fill, K timed batches between barriers, drain; returns the timed wall time."""
        for _ in range(self.engine.program.fill_calls):
            self._train(record=False)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(self.settings.timed_batches):
            self._train(record=True)
        dist.barrier()
        elapsed = time.perf_counter() - start
        self.engine.drain()
        return elapsed

    def _train(self, record: bool) -> None:
        self.engine.executor.timeline = self.timeline if record else None
        self.engine.train_batch(step_microbatches(self.settings, self.batch))
        self.batch += 1


def mean_durations(timeline: Timeline) -> dict:
    """Mean F, B and optimizer-step durations of this rank's recorded actions."""
    durations: dict = {"F": [], "B": [], "step": []}
    for event in timeline.events:
        kind = event.action.kind
        key = "step" if kind.is_optimizer_step else kind.value
        if key in durations:
            durations[key].append(event.end - event.start)
    return {key: statistics.mean(values) if values else 0.0 for key, values in durations.items()}


def measure(rank: int, world_size: int, settings: AsyncSettings) -> dict:
    torch.manual_seed(0)
    ps = ParallelState.initialize(pipeline=settings.p)
    runners = {name: Runner(settings, ps, name) for name in SCHEDULES}
    times = take_turns(SCHEDULES, settings.rounds, lambda name, _: runners[name].block())
    return {"times": times, "costs": {name: mean_durations(r.timeline) for name, r in runners.items()}}


def predicted_per_microbatch(name: str, settings: AsyncSettings, costs: CostModel) -> float:
    p, m = settings.p, settings.num_microbatches
    if name == "1f1b":
        return simulate(build_schedule(name, p, m), costs).makespan / m
    short, long = (simulate(build_schedule(name, p, m, batches=b), costs).makespan for b in (6, 8))
    return (long - short) / (2 * m)


def table(settings: AsyncSettings, per_rank: list[dict]) -> list[str]:
    p, m = settings.p, settings.num_microbatches
    microbatches_timed = settings.timed_batches * m
    lines = [f"p={p} m={m}: GPT {settings.num_layers} layers, hidden {settings.hidden_size}, "
             f"seq {settings.seq_length}, micro batch {settings.micro_batch_size}; {settings.rounds} rounds of "
             f"{settings.timed_batches} timed batches"]
    lines += report.markdown(["schedule", "measured ms/microbatch", "simulated ms/microbatch", "measured vs flush",
                              "simulated vs flush"])
    measured, predicted, ratio = {}, {}, {}
    times = per_rank[0]["times"]
    for name in SCHEDULES:
        measured[name] = statistics.median(times[name]) / microbatches_timed * 1e3
        ratio[name] = median_ratio(times[name], times["1f1b"])
        stage_costs = [rank_result["costs"][name] for rank_result in per_rank]
        costs = CostModel(forward=[c["F"] for c in stage_costs], backward=[c["B"] for c in stage_costs],
                          step=statistics.mean(c["step"] for c in stage_costs))
        predicted[name] = predicted_per_microbatch(name, settings, costs) * 1e3
    for name in SCHEDULES:
        lines.append(report.markdown_row([name, f"{measured[name]:.1f}", f"{predicted[name]:.1f}", f"{ratio[name]:.3f}",
                                          f"{predicted[name] / predicted['1f1b']:.3f}"]))
    lines.append(f"unit-cost flush bubble (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f}: asynchronous / flush "
                 f"should be about {m / (m + p - 1):.3f}")
    return lines


def main() -> None:
    parser = cli.parser(__doc__, quick="2 rounds of 2 timed batches, a smoke test")
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    lines = []
    for m in args.m:
        settings = AsyncSettings.of(args.p, m, args.quick)
        block = table(settings, run_distributed(args.p, measure, settings, timeout=3600))
        print("\n".join(block) + "\n", flush=True)
        lines += block + [""]
    if not args.quick:
        report.write_result("bench_async_schedules", "PipeDream and 2BW against PipeDream-Flush",
                            "python benchmarks/bench_async_schedules.py", lines)


if __name__ == "__main__":
    main()
