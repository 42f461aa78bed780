"""megapipe's flush schedules against torch.distributed.pipelining, and measured against simulated bubbles.

    python benchmarks/bench_pipeline.py            # p = 2 and 4, 6 timed steps per system and row
    python benchmarks/bench_pipeline.py --quick    # 2 timed steps per row, a smoke test
    python benchmarks/bench_pipeline.py --rounds 20 --json out.json   # tighter ratios, raw pairs kept

The default run makes 96 training steps in two worlds; on a 2-core machine shared with other
work (load average 10-40) it took about 7 minutes, at the ~0.6 s/step of an idle machine it
needs about 2.

For each pipeline size p and schedule (GPipe, 1F1B, interleaved 1F1B with 2 chunks per
rank, ZB-H1, ZB-H2, interleaved zero bubble with 2 chunks per rank, and on the V placement ZBV
and DualPipeV) one world of p processes (gloo, one thread each) builds the same GPT twice from
the same megapipe stage modules and weights: once trained by ``PipelineEngine``, once by
PyTorch's ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (for ZB-H1, ZB-H2
and interleaved-zb ``ScheduleInterleavedZeroBubble``, its split-backward schedule, over one
stage per rank for ZB-H1 and ZB-H2 and over the same two stages per rank for interleaved-zb,
whose order it is; for ZBV and DualPipeV its ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
over the same two chunks per rank in a V) over ``PipelineStage``\\ s that wrap those modules.
Both get the same microbatches and the same
AdamW kernel, and the losses of the first two steps must agree (same weights, same data,
same update). The two systems then alternate step by step, the order flipping every round
and every step sitting between two barriers, so that a noisy machine slows both alike. The
ratio reported is the median of the per-round ratios megapipe / PyTorch.

The bubble table reads the timelines of the same timed steps (megapipe's executor records
one; PyTorch's stages are timed the same way here): per rank, the idle share of the
forward/backward phase, from the first F to the last B over all ranks (the optimizer step,
whose all-reduces synchronise megapipe's ranks, is left out). Next to them, the simulator's
prediction for megapipe's schedule fed with the median forward and backward time of every
stage measured on megapipe's timeline (DualPipeV's overlapped pairs charged as the sum of their
two passes: on one CPU thread both systems run a pair one pass after the other).
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from megapipe.config import ModelConfig  # noqa: E402
from megapipe.models import build_model_chunks  # noqa: E402
from megapipe.models.gpt import masked_mean  # noqa: E402
from megapipe.optim import OptimizerConfig, trainable_params, weight_decay_groups  # noqa: E402
from megapipe.optim.optimizer import build_inner_optimizer  # noqa: E402
from megapipe.parallel.state import ParallelState  # noqa: E402
from megapipe.pipeline.ir.actions import Action, ActionKind  # noqa: E402
from megapipe.pipeline.runtime.engine import PipelineEngine  # noqa: E402
from megapipe.pipeline.ir.schedules import build_schedule, schedule_spec  # noqa: E402
from megapipe.pipeline.analysis.simulate import CostModel, simulate  # noqa: E402
from megapipe.pipeline.analysis.timeline import Timeline  # noqa: E402
from megapipe.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402
from megapipe.testing.worlds import run_distributed  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
             ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2)]  # name, chunks per rank
ZERO_BUBBLE = ("zb-h1", "zb-h2", "interleaved-zb")  # PyTorch's counterpart: ScheduleInterleavedZeroBubble (over
#                                                      one stage per rank for zb-h1/zb-h2, the same order at v = 2)
SYSTEMS = ("megapipe", "torch")
LOSS_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Settings:
    """Model and run sizes; the model is the one of the environment probe's pipelining run."""

    num_layers: int = 8
    hidden_size: int = 256
    num_attention_heads: int = 4
    seq_length: int = 128
    vocab_size: int = 1024
    micro_batch_size: int = 2
    num_microbatches: int = 8
    warmup_steps: int = 2  # per system; their losses are the equality check
    rounds: int = 6  # timed steps per system

    def model_config(self) -> ModelConfig:
        # No dropout (both systems must compute the same function) and untied embeddings
        # (PyTorch's schedules have no gradient reduction for a weight shared by two stages).
        return ModelConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                           num_attention_heads=self.num_attention_heads, vocab_size=self.vocab_size,
                           seq_length=self.seq_length, hidden_dropout=0.0, attention_dropout=0.0,
                           untie_embeddings_and_output_weights=True)

    def describe(self) -> str:
        return (f"GPT, {self.num_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads, "
                f"seq {self.seq_length}, vocab {self.vocab_size}, fp32; {self.num_microbatches} microbatches of "
                f"{self.micro_batch_size}; AdamW; gloo; {self.rounds} timed steps per system and row after "
                f"{self.warmup_steps} warm-up steps")


def optimizer_config() -> OptimizerConfig:
    return OptimizerConfig(optimizer="adamw", lr=1e-3, weight_decay=0.01, clip_grad=0.0)


def batch(settings: Settings, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels ``[m * b, s]`` of one step, the same on every rank."""
    g = torch.Generator().manual_seed(step)
    shape = (settings.num_microbatches * settings.micro_batch_size, settings.seq_length)
    return (torch.randint(0, settings.vocab_size, shape, generator=g),
            torch.randint(0, settings.vocab_size, shape, generator=g))


# ---- the two systems -----------------------------------------------------------------------------
class TensorStage(nn.Module):
    """A megapipe stage as PyTorch's ``PipelineStage`` wants it: tensors in, tensors out.

    The first stage takes token ids, the others the previous stage's ``[s, b, h]`` output;
    the last stage returns its logits ``[b, s, V]`` and ``loss_fn`` below finishes the head.
    """

    def __init__(self, chunk: nn.Module):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk.pre_process:
            return self.chunk(None, {"tokens": x})
        return self.chunk(x, {})


def make_loss_fn(ps: ParallelState):
    """The rest of megapipe's GPT head (cross-entropy, mean over tokens) for PyTorch's schedule."""
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses = vocab_parallel_cross_entropy(logits.transpose(0, 1), labels.transpose(0, 1), ps.tp_group, 0)
        return masked_mean(losses.transpose(0, 1), torch.ones_like(labels, dtype=torch.float32))
    return loss_fn


class MegapipeRunner:
    """One training step with megapipe's ``PipelineEngine``, recording its timeline (unless told not to)."""

    def __init__(self, chunks, ps: ParallelState, settings: Settings, schedule: str, record_timeline: bool = True):
        self.settings = settings
        self.timeline = Timeline()
        shape = (settings.seq_length, settings.micro_batch_size, settings.hidden_size)
        self.engine = PipelineEngine(chunks, ps, optimizer_config(), schedule, settings.num_microbatches, shape,
                                     timeline=self.timeline if record_timeline else None)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[float]:
        b = self.settings.micro_batch_size
        microbatches = [{"tokens": t, "labels": y, "loss_mask": torch.ones_like(y, dtype=torch.float32)}
                        for t, y in zip(tokens.split(b), labels.split(b))]
        return self.engine.train_batch(microbatches).losses


class TorchRunner:
    """One training step with torch.distributed.pipelining over the same stage modules.

    Its stages' forward and backward passes are timed into ``timeline`` like megapipe's
    executor does; the last stage's forward includes the loss, as megapipe's does.
    """

    def __init__(self, chunks, ps: ParallelState, settings: Settings, schedule: str):
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                  ScheduleZBVZeroBubble)
        self.rank, self.timeline, self._pending_forward = ps.pp_rank, Timeline(), None
        num_stages = ps.pp_size * len(chunks)
        stages = [PipelineStage(TensorStage(chunk), stage, num_stages, torch.device("cpu"), group=ps.pp_group)
                  for stage, chunk in zip(ps.chunk_stages(), chunks)]  # the same stages on the same ranks
        for stage in stages:
            self._time_passes(stage)
        m, loss_fn = settings.num_microbatches, self._timed_loss(make_loss_fn(ps))
        if schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
        elif schedule in ZERO_BUBBLE:
            self.schedule = ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn)
        elif schedule in ("zbv", "dualpipev"):
            self.schedule = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[schedule](
                stages, m, loss_fn=loss_fn)
        else:
            self.schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], m, loss_fn=loss_fn)
        params = trainable_params(chunks)  # megapipe's own parameter groups and AdamW kernel
        config = optimizer_config()
        self.optimizer, _ = build_inner_optimizer(weight_decay_groups(params, params, config.weight_decay), config,
                                                  torch.device("cpu"))
        self.first = any(stage.is_first for stage in stages)
        self.last = any(stage.is_last for stage in stages)

    def _time_passes(self, stage) -> None:
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def timed_forward(microbatch, *args, **kwargs):
            start = time.time()
            output = forward(microbatch, *args, **kwargs)
            if stage.is_last:  # the schedule computes the loss right after; it ends this F
                self._pending_forward = (stage.stage_index, microbatch, start)
            else:
                self._record(ActionKind.F, stage.stage_index, microbatch, start)
            return output

        def timed_backward(microbatch, *args, **kwargs):
            start = time.time()
            result = backward(microbatch, *args, **kwargs)
            kind = ActionKind.B if kwargs.get("full_backward", True) else ActionKind.BI
            self._record(kind, stage.stage_index, microbatch, start)
            return result

        def timed_weight(microbatch, *args, **kwargs):
            start = time.time()
            result = weight(microbatch, *args, **kwargs)
            self._record(ActionKind.BW, stage.stage_index, microbatch, start)
            return result

        stage.forward_one_chunk, stage.backward_one_chunk = timed_forward, timed_backward
        stage.backward_weight_one_chunk = timed_weight

    def _timed_loss(self, loss_fn):
        def timed(logits, labels):
            loss = loss_fn(logits, labels)
            if self._pending_forward is not None:  # None when PyTorch infers shapes at the first step
                self._record(ActionKind.F, *self._pending_forward)
                self._pending_forward = None
            return loss
        return timed

    def _record(self, kind: ActionKind, stage: int, microbatch: int, start: float) -> None:
        self.timeline.record(self.rank, Action(kind, stage, microbatch), start, time.time())

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[float]:
        losses: list = []
        self.schedule.step(*((tokens,) if self.first else ()), target=labels if self.last else None,
                           losses=losses if self.last else None, return_outputs=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return [loss.item() for loss in losses]


# ---- one world -----------------------------------------------------------------------------------
def timed_step(runner, tokens, labels) -> tuple[float, float, list[float]]:
    """Wall time of one step between barriers, this process's CPU time in it, and the losses."""
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    losses = runner.step(tokens, labels)
    cpu = time.process_time() - cpu_start
    dist.barrier()
    return time.perf_counter() - start, cpu, losses


def compare_schedule(settings: Settings, schedule: str, v: int) -> dict:
    """Run both systems on this rank for one schedule; return times, losses and both timelines."""
    ps = ParallelState.initialize(pipeline=dist.get_world_size(), virtual_pipeline=v,
                                  placement=schedule_spec(schedule).placement)
    config = settings.model_config()
    mine, theirs = build_model_chunks("gpt", config, ps), build_model_chunks("gpt", config, ps)
    for a, b in zip(mine, theirs):
        b.load_state_dict(a.state_dict())
    runners = {"megapipe": MegapipeRunner(mine, ps, settings, schedule),
               "torch": TorchRunner(theirs, ps, settings, schedule)}

    check_losses = []  # per warm-up step: (megapipe's losses, PyTorch's losses)
    for step in range(settings.warmup_steps):
        tokens, labels = batch(settings, step)
        check_losses.append(tuple(timed_step(runners[name], tokens, labels)[2] for name in SYSTEMS))

    wall, cpu, timelines = ({name: [] for name in SYSTEMS} for _ in range(3))  # timelines: one per timed step
    for r in range(settings.rounds):
        tokens, labels = batch(settings, settings.warmup_steps + r)
        for name in SYSTEMS if r % 2 == 0 else reversed(SYSTEMS):
            recorded = len(runners[name].timeline.events)
            seconds, cpu_seconds, _ = timed_step(runners[name], tokens, labels)
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
            timelines[name].append(Timeline(runners[name].timeline.events[recorded:]).to_dict())
    return {"schedule": schedule, "v": v, "wall": wall, "cpu": cpu,
            "check_losses": check_losses if ps.is_last_stage else None, "timelines": timelines}


def world(rank: int, world_size: int, settings: Settings, schedules: list[tuple[str, int]]) -> list[dict]:
    return [compare_schedule(settings, schedule, v) for schedule, v in schedules]


# ---- analysis ------------------------------------------------------------------------------------
def speed_row(p: int, per_rank: list[dict]) -> dict:
    """Step times, paired ratios, CPU time and the loss check of one (p, schedule)."""
    wall = per_rank[0]["wall"]  # every step ends in a barrier, so all ranks see the same time
    ratios = [a / b for a, b in zip(wall["megapipe"], wall["torch"])]
    cpu = {name: statistics.median(sum(r["cpu"][name][i] for r in per_rank) for i in range(len(wall[name])))
           for name in SYSTEMS}
    losses = next(r["check_losses"] for r in per_rank if r["check_losses"] is not None)
    diffs = [max(abs(a - b) for a, b in zip(mine, theirs)) for mine, theirs in losses]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"p": p, "schedule": per_rank[0]["schedule"], "v": per_rank[0]["v"], "ratios": ratios,
            "megapipe": statistics.median(wall["megapipe"]), "torch": statistics.median(wall["torch"]),
            "ratio": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
            "best_ratio": min(wall["megapipe"]) / min(wall["torch"]),
            "cpu_megapipe": cpu["megapipe"], "cpu_torch": cpu["torch"],
            "first_loss": losses[0][0][0], "loss_diff": max(diffs)}


def measured_bubble(p: int, per_rank: list[dict], system: str) -> dict:
    """Idle share per rank of the F/B phase (mean over timed steps) and median F and B time per stage (a
    split backward's B is its BI and BW together; their own medians come as ``input_backward`` and
    ``weight_backward``)."""
    idle = {rank: [] for rank in range(p)}
    spans, durations = [], {}
    for step in range(len(per_rank[0]["timelines"][system])):
        merged = Timeline.merge(Timeline.from_dict(r["timelines"][system][step]) for r in per_rank)
        compute = Timeline(e for e in merged.events if e.action.kind.is_compute)  # F and B, no STEP
        window = (min(e.start for e in compute.events), max(e.end for e in compute.events))
        spans.append(window[1] - window[0])
        for rank, fraction in compute.idle_fraction(window).items():
            idle[rank].append(fraction)
        for e in compute.events:
            durations.setdefault((e.action.kind, e.action.stage), []).append(e.end - e.start)
    stages = range(p * per_rank[0]["v"])

    def median(kind):
        return [statistics.median(durations[(kind, s)]) for s in stages]

    measured = {"idle": [statistics.mean(idle[rank]) for rank in range(p)], "span": statistics.median(spans),
                "forward": median(ActionKind.F)}
    if all((ActionKind.BI, s) in durations for s in stages):
        measured.update(input_backward=median(ActionKind.BI), weight_backward=median(ActionKind.BW))
    if all((ActionKind.B, s) in durations for s in stages):  # whole backwards (some schedules mix both)
        return dict(measured, backward=median(ActionKind.B))
    return dict(measured, backward=[i + w for i, w in zip(measured["input_backward"], measured["weight_backward"])])


def bubble_row(p: int, per_rank: list[dict], settings: Settings) -> dict:
    """Both systems' measured bubbles and the simulator's prediction from megapipe's measured costs."""
    schedule, v = per_rank[0]["schedule"], per_rank[0]["v"]
    measured = {system: measured_bubble(p, per_rank, system) for system in SYSTEMS}
    mine = measured["megapipe"]
    costs = CostModel(forward=mine["forward"], backward=mine["backward"], input_backward=mine.get("input_backward"),
                      weight_backward=mine.get("weight_backward"), step=0, overlap=operator.add)
    predicted = simulate(build_schedule(schedule, p, settings.num_microbatches, v), costs)
    return {"p": p, "schedule": schedule, "v": v, "measured": measured,
            "predicted": [float(x) for x in predicted.idle_fraction], "predicted_span": float(predicted.makespan)}


# ---- report --------------------------------------------------------------------------------------
def label(schedule: str, v: int) -> str:
    return {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": f"Interleaved1F1B, v={v}",
            "zb-h1": "ZB-H1 (PyTorch: InterleavedZeroBubble)", "zb-h2": "ZB-H2 (PyTorch: InterleavedZeroBubble)",
            "interleaved-zb": f"InterleavedZeroBubble, v={v}",
            "zbv": "ZBV, V placement (PyTorch: ZBVZeroBubble)",
            "dualpipev": "DualPipeV, V placement (PyTorch: DualPipeV)"}[schedule]


def print_speed(rows: list[dict]) -> None:
    print("\nStep time, megapipe vs torch.distributed.pipelining (same GPT, split, weights, data and AdamW)")
    print("| p | schedule | megapipe s/step | PyTorch s/step | megapipe / PyTorch: median of pairs [quartiles] "
          "| best / best | CPU s/step, all ranks: megapipe / PyTorch | step-1 loss | max loss diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['p']} | {label(r['schedule'], r['v'])} | {r['megapipe']:.3f} | {r['torch']:.3f} | "
              f"**{r['ratio']:.2f}** [{r['q1']:.2f}-{r['q3']:.2f}] | {r['best_ratio']:.2f} | "
              f"{r['cpu_megapipe']:.2f} / {r['cpu_torch']:.2f} | {r['first_loss']:.4f} | {r['loss_diff']:.1e} |")
    pairs = [ratio for r in rows for ratio in r["ratios"]]
    print(f"All {len(pairs)} pairs: geometric mean of megapipe / PyTorch = "
          f"{math.exp(statistics.mean(math.log(x) for x in pairs)):.3f}")
    print_best_against_1f1b(rows)


def print_best_against_1f1b(rows: list[dict]) -> None:
    """The fastest megapipe schedule of each p against PyTorch's Schedule1F1B measured in the same world (the
    medians of two rows, timed minutes apart, so noisier than a paired ratio)."""
    for p in sorted({r["p"] for r in rows}):
        theirs = next((r["torch"] for r in rows if r["p"] == p and r["schedule"] == "1f1b"), None)
        if theirs is None:
            continue
        best = min((r for r in rows if r["p"] == p), key=lambda r: r["megapipe"])
        print(f"p={p}: the fastest megapipe schedule, {label(best['schedule'], best['v'])}, "
              f"{best['megapipe']:.3f} s/step = {best['megapipe'] / theirs:.2f} of PyTorch's Schedule1F1B "
              f"({theirs:.3f} s/step)")


def print_bubble(rows: list[dict]) -> None:
    print("\nBubble: idle share of the forward/backward phase per pipeline rank (first F to last B over all ranks, "
          "optimizer step excluded), measured on timelines of the timed steps; simulated = megapipe's schedule "
          "in the simulator with megapipe's median F and B time of every stage")
    print("| p | schedule | megapipe, rank 0.. | simulated | PyTorch | mean: megapipe / simulated / PyTorch "
          "| F/B phase s: megapipe / simulated / PyTorch | F, B ms per stage: megapipe / PyTorch |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        mine, theirs = r["measured"]["megapipe"], r["measured"]["torch"]
        means = " / ".join(f"{statistics.mean(idle):.2f}" for idle in (mine["idle"], r["predicted"], theirs["idle"]))
        print(f"| {r['p']} | {label(r['schedule'], r['v'])} | {_values(mine['idle'])} | {_values(r['predicted'])} | "
              f"{_values(theirs['idle'])} | {means} | {mine['span']:.3f} / {r['predicted_span']:.3f} / "
              f"{theirs['span']:.3f} | {_pass_ms(mine)} / {_pass_ms(theirs)} |")


def _values(values: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in values)


def _pass_ms(measured: dict) -> str:
    """Mean over stages of the median forward and backward time, in milliseconds."""
    return f"{1e3 * statistics.mean(measured['forward']):.0f}, {1e3 * statistics.mean(measured['backward']):.0f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps per row: a smoke test, noisy numbers")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per system and row (default 6)")
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", choices=[name for name, _ in SCHEDULES],
                        default=[name for name, _ in SCHEDULES])
    parser.add_argument("--json", metavar="PATH", help="also write both tables' rows (with every paired ratio) here")
    args = parser.parse_args(argv)
    settings = Settings(rounds=args.rounds or (2 if args.quick else Settings.rounds))
    schedules = [(name, v) for name, v in SCHEDULES if name in args.schedules]

    print(f"model: {settings.describe()}")
    print(f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start, torch "
          f"{torch.__version__}, one thread per rank. On 2 cores, p=4 oversubscribes the machine (4 processes): "
          "an idle rank lends its core to a busy one, so bubbles cost less than on dedicated devices and "
          "measured per-stage times include time sharing. Other load slows both systems alike but adds noise.")
    speed, bubble = [], []
    for p in args.pipeline_sizes:
        start = time.perf_counter()
        results = run_distributed(p, world, settings, schedules, timeout=3600, collective_timeout=600)
        for i in range(len(schedules)):
            per_rank = [results[rank][i] for rank in range(p)]
            speed.append(speed_row(p, per_rank))
            bubble.append(bubble_row(p, per_rank, settings))
        print(f"p={p}: {time.perf_counter() - start:.0f} s", flush=True)
    print_speed(speed)
    print_bubble(bubble)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": asdict(settings), "speed": speed, "bubble": bubble}, f, indent=1)
    bad = [r for r in speed if r["loss_diff"] > LOSS_TOLERANCE]
    if bad:
        print(f"FAILED: the two systems' losses differ by more than {LOSS_TOLERANCE} for "
              + ", ".join(f"p={r['p']} {r['schedule']}" for r in bad))
        return 1
    print(f"losses of the first {settings.warmup_steps} steps agree within {LOSS_TOLERANCE} in every row "
          "(same weights, data and update)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
