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

import operator
import statistics
import sys
import time
from dataclasses import asdict
from functools import partial

import torch
import torch.distributed as dist

from harness import cli, ratios, report
from harness.models import MegapipeRunner, TensorStage, adamw, batch, make_loss_fn, megapipe_adamw_for, same_weights
from harness.pairing import take_turns, timed
from harness.settings import Settings
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog import build_schedule, schedule_descriptor
from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.schedules.analysis.timeline import Timeline
from megapipe.testing.worlds import run_distributed

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
             ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2)]  # name, chunks per rank
ZERO_BUBBLE = ("zb-h1", "zb-h2", "interleaved-zb")  # PyTorch's counterpart: ScheduleInterleavedZeroBubble (over
#                                                      one stage per rank for zb-h1/zb-h2, the same order at v = 2)
SYSTEMS = ("megapipe", "torch")
LOSS_TOLERANCE = 1e-5


def describe(settings: Settings) -> str:
    return (f"{settings.describe_model()}; {settings.num_microbatches} microbatches of {settings.micro_batch_size}; "
            f"AdamW; gloo; {settings.rounds} timed steps per system and row after {settings.warmup_steps} warm-up "
            "steps")


# ---- the two systems -----------------------------------------------------------------------------
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
        self.optimizer = megapipe_adamw_for(chunks, adamw())  # megapipe's own parameter groups and AdamW kernel
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
def compare_schedule(settings: Settings, schedule: str, v: int) -> dict:
    """Run both systems on this rank for one schedule; return times, losses and both timelines."""
    ps = ParallelState.initialize(pipeline=dist.get_world_size(), virtual_pipeline=v,
                                  placement=schedule_descriptor(schedule).placement)
    config = settings.model_config()
    mine = build_model_chunks("gpt", config, ps)
    runners = {"megapipe": MegapipeRunner(mine, ps, settings, schedule, adamw(), record_timeline=True),
               "torch": TorchRunner(same_weights(config, ps, mine), ps, settings, schedule)}

    check_losses = []  # per warm-up step: (megapipe's losses, PyTorch's losses)
    for step in range(settings.warmup_steps):
        tokens, labels = batch(settings, step)
        check_losses.append(tuple(timed(partial(runners[name].step, tokens, labels))[2] for name in SYSTEMS))

    def timed_step(name: str, r: int) -> tuple[float, float, dict]:
        """One timed step: wall and CPU seconds, and the timeline it recorded."""
        recorded = len(runners[name].timeline.events)
        seconds, cpu_seconds, _ = timed(partial(runners[name].step, *batch(settings, settings.warmup_steps + r)))
        return seconds, cpu_seconds, Timeline(runners[name].timeline.events[recorded:]).to_dict()

    turns = take_turns(SYSTEMS, settings.rounds, timed_step)
    wall, cpu, timelines = ({name: [t[k] for t in turns[name]] for name in SYSTEMS} for k in range(3))
    return {"schedule": schedule, "v": v, "wall": wall, "cpu": cpu,
            "check_losses": check_losses if ps.is_last_stage else None, "timelines": timelines}


def world(rank: int, world_size: int, settings: Settings, schedules: list[tuple[str, int]]) -> list[dict]:
    return [compare_schedule(settings, schedule, v) for schedule, v in schedules]


# ---- analysis ------------------------------------------------------------------------------------
def speed_row(p: int, per_rank: list[dict]) -> dict:
    """Step times, paired ratios, CPU time and the loss check of one (p, schedule)."""
    wall = per_rank[0]["wall"]  # every step ends in a barrier, so all ranks see the same time
    pairs = ratios.paired(wall["megapipe"], wall["torch"])
    cpu = {name: statistics.median(sum(r["cpu"][name][i] for r in per_rank) for i in range(len(wall[name])))
           for name in SYSTEMS}
    losses = next(r["check_losses"] for r in per_rank if r["check_losses"] is not None)
    diffs = [max(abs(a - b) for a, b in zip(mine, theirs)) for mine, theirs in losses]
    q1, _, q3 = ratios.quartiles(pairs)
    return {"p": p, "schedule": per_rank[0]["schedule"], "v": per_rank[0]["v"], "ratios": pairs,
            "megapipe": statistics.median(wall["megapipe"]), "torch": statistics.median(wall["torch"]),
            "ratio": statistics.median(pairs), "q1": q1, "q3": q3,
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
    print("\n".join(report.markdown(
        ["p", "schedule", "megapipe s/step", "PyTorch s/step", "megapipe / PyTorch: median of pairs [quartiles]",
         "best / best", "CPU s/step, all ranks: megapipe / PyTorch", "step-1 loss", "max loss diff"],
        ([r["p"], label(r["schedule"], r["v"]), f"{r['megapipe']:.3f}", f"{r['torch']:.3f}",
          f"**{r['ratio']:.2f}** [{r['q1']:.2f}-{r['q3']:.2f}]", f"{r['best_ratio']:.2f}",
          f"{r['cpu_megapipe']:.2f} / {r['cpu_torch']:.2f}", f"{r['first_loss']:.4f}", f"{r['loss_diff']:.1e}"]
         for r in rows))))
    pairs = [ratio for r in rows for ratio in r["ratios"]]
    print(f"All {len(pairs)} pairs: geometric mean of megapipe / PyTorch = {ratios.geometric_mean(pairs):.3f}")
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
    lines = []
    for r in rows:
        mine, theirs = r["measured"]["megapipe"], r["measured"]["torch"]
        means = " / ".join(f"{statistics.mean(idle):.2f}" for idle in (mine["idle"], r["predicted"], theirs["idle"]))
        lines.append([r["p"], label(r["schedule"], r["v"]), _values(mine["idle"]), _values(r["predicted"]),
                      _values(theirs["idle"]), means,
                      f"{mine['span']:.3f} / {r['predicted_span']:.3f} / {theirs['span']:.3f}",
                      f"{_pass_ms(mine)} / {_pass_ms(theirs)}"])
    print("\n".join(report.markdown(
        ["p", "schedule", "megapipe, rank 0..", "simulated", "PyTorch", "mean: megapipe / simulated / PyTorch",
         "F/B phase s: megapipe / simulated / PyTorch", "F, B ms per stage: megapipe / PyTorch"], lines)))


def _values(values: list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in values)


def _pass_ms(measured: dict) -> str:
    """Mean over stages of the median forward and backward time, in milliseconds."""
    return f"{1e3 * statistics.mean(measured['forward']):.0f}, {1e3 * statistics.mean(measured['backward']):.0f}"


def main(argv=None) -> int:
    parser = cli.parser(__doc__, quick="2 timed steps per row: a smoke test, noisy numbers",
                        rounds_help="timed steps per system and row (default 6)",
                        json="also write both tables' rows (with every paired ratio) here")
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedules", nargs="+", choices=[name for name, _ in SCHEDULES],
                        default=[name for name, _ in SCHEDULES])
    args = parser.parse_args(argv)
    settings = Settings(rounds=cli.rounds_of(args, Settings.rounds))
    schedules = [(name, v) for name, v in SCHEDULES if name in args.schedules]

    print(f"model: {describe(settings)}")
    print(f"machine: {report.machine()}, torch "
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
    print(f"\nload average at the end: {report.load_average()}")
    report.write_json(args.json, {"settings": asdict(settings), "speed": speed, "bubble": bubble})
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
