"""PipeDream and PipeDream-2BW against PipeDream-Flush (1F1B): time per microbatch in steady
state, measured on this machine's CPU, next to the simulator's prediction.

    python benchmarks/bench_async_schedules.py            # p = 2, m = 2 and 4; ~3 min on an idle 2-core machine
    python benchmarks/bench_async_schedules.py --quick    # 2 rounds of 2 timed batches, a smoke test

One world of p processes (gloo, one thread each) holds one GPT per schedule, all from the
same weights, fed the same microbatches. Rounds alternate the schedules so that a noisy
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

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megapipe.config import ModelConfig  # noqa: E402
from megapipe.models import build_model_chunks  # noqa: E402
from megapipe.optim import OptimizerConfig  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402
from megapipe.pipeline.runtime.engine import PipelineEngine  # noqa: E402
from megapipe.pipeline.ir.schedules import build_schedule  # noqa: E402
from megapipe.pipeline.analysis.simulate import CostModel, simulate  # noqa: E402
from megapipe.pipeline.analysis.timeline import Timeline  # noqa: E402
from megapipe.testing.worlds import run_distributed  # noqa: E402

SCHEDULES = ("1f1b", "pipedream", "2bw")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_async_schedules.md")


@dataclass(frozen=True)
class Settings:
    p: int = 2
    m: int = 2
    rounds: int = 7
    timed_batches: int = 4
    layers_per_stage: int = 2
    hidden: int = 256
    seq: int = 128
    micro_batch: int = 4

    def model_config(self) -> ModelConfig:
        return ModelConfig(num_layers=self.layers_per_stage * self.p, hidden_size=self.hidden, num_attention_heads=4,
                           vocab_size=512, seq_length=self.seq, hidden_dropout=0.0, attention_dropout=0.0,
                           untie_embeddings_and_output_weights=True)


def microbatches(settings: Settings, first: int) -> list[dict]:
    out = []
    for i in range(first, first + settings.m):
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, 512, (settings.micro_batch, settings.seq), generator=g)
        out.append({"tokens": tokens, "labels": torch.roll(tokens, -1, 1),
                    "loss_mask": torch.ones(settings.micro_batch, settings.seq)})
    return out


class Runner:
    """One schedule's engine on this rank, with the timeline of its timed batches."""

    def __init__(self, settings: Settings, ps: ParallelState, schedule: str):
        config = settings.model_config()
        self.settings, self.schedule = settings, schedule
        chunks = build_model_chunks("gpt", config, ps, seed=1234)
        self.timeline = Timeline()
        self.engine = PipelineEngine(chunks, ps, OptimizerConfig(optimizer="adamw", lr=1e-4), schedule, settings.m,
                                     (settings.seq, settings.micro_batch, settings.hidden), timeline=self.timeline)
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
        self.engine.train_batch(microbatches(self.settings, self.batch * self.settings.m))
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


def measure(rank: int, world_size: int, settings: Settings) -> dict:
    torch.manual_seed(0)
    ps = ParallelState.initialize(pipeline=settings.p)
    runners = {name: Runner(settings, ps, name) for name in SCHEDULES}
    times = {name: [] for name in SCHEDULES}
    for round_index in range(settings.rounds):
        order = SCHEDULES if round_index % 2 == 0 else SCHEDULES[::-1]
        for name in order:
            times[name].append(runners[name].block())
    return {"times": times, "costs": {name: mean_durations(r.timeline) for name, r in runners.items()}}


def predicted_per_microbatch(name: str, settings: Settings, costs: CostModel) -> float:
    p, m = settings.p, settings.m
    if name == "1f1b":
        return simulate(build_schedule(name, p, m), costs).makespan / m
    short, long = (simulate(build_schedule(name, p, m, batches=b), costs).makespan for b in (6, 8))
    return (long - short) / (2 * m)


def report(settings: Settings, per_rank: list[dict]) -> list[str]:
    p, m = settings.p, settings.m
    microbatches_timed = settings.timed_batches * m
    lines = [f"p={p} m={m}: GPT {settings.layers_per_stage * p} layers, hidden {settings.hidden}, "
             f"seq {settings.seq}, micro batch {settings.micro_batch}; {settings.rounds} rounds of "
             f"{settings.timed_batches} timed batches",
             "| schedule | measured ms/microbatch | simulated ms/microbatch | measured vs flush | simulated vs flush |",
             "|---|---|---|---|---|"]
    measured, predicted, ratio = {}, {}, {}
    times = per_rank[0]["times"]
    for name in SCHEDULES:
        measured[name] = statistics.median(times[name]) / microbatches_timed * 1e3
        ratio[name] = statistics.median(t / flush for t, flush in zip(times[name], times["1f1b"]))
        stage_costs = [rank_result["costs"][name] for rank_result in per_rank]
        costs = CostModel(forward=[c["F"] for c in stage_costs], backward=[c["B"] for c in stage_costs],
                          step=statistics.mean(c["step"] for c in stage_costs))
        predicted[name] = predicted_per_microbatch(name, settings, costs) * 1e3
    for name in SCHEDULES:
        lines.append(f"| {name} | {measured[name]:.1f} | {predicted[name]:.1f} | "
                     f"{ratio[name]:.3f} | {predicted[name] / predicted['1f1b']:.3f} |")
    lines.append(f"unit-cost flush bubble (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f}: asynchronous / flush "
                 f"should be about {m / (m + p - 1):.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    lines = []
    for m in args.m:
        settings = Settings(p=args.p, m=m, rounds=2 if args.quick else 7, timed_batches=2 if args.quick else 4)
        block = report(settings, run_distributed(args.p, measure, settings, timeout=3600))
        print("\n".join(block) + "\n", flush=True)
        lines += block + [""]
    if not args.quick:
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            f.write("# PipeDream and 2BW against PipeDream-Flush\n\n`python benchmarks/bench_async_schedules.py`\n\n")
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
