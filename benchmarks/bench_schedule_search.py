"""A schedule searched for measured stage costs against every named schedule, on the executor.

    python benchmarks/bench_schedule_search.py              # p = 4, m = 4, rank 1 1.5x slower, 8 rounds
    python benchmarks/bench_schedule_search.py --rounds 16 --microbatches 8

One world of p processes (gloo) trains the same small GPT with megapipe's ``PipelineEngine``
under each named flush schedule (GPipe, 1F1B, ZB-H1, ZB-H2 on one chunk per rank; interleaved
1F1B and interleaved zero bubble on two) and under ``--pipeline-schedule auto``, the schedule
searched (``schedules/analysis/schedule_search.py``) for the stage costs measured on the
executor's own timeline, with one and with two chunks per rank, within 1F1B's memory (p
microbatches' activations per rank).

EMULATED STAGE COSTS (an artificial delay, not model compute): before every F, BI and BW each
rank sleeps ``--pass-ms`` milliseconds (a whole B sleeps twice that) divided by its chunks per
rank, and rank ``--slow-rank`` sleeps 1.5x as long, so that one stage is 1.5x slower. The model
is small (its own compute is a few percent of a pass), so on a 2-core machine the p sleeping
processes behave like p dedicated devices; real compute, gradients and messages still run.
The costs the search gets are not the flags: they are the medians of F, BI and BW per stage
read off a timeline recorded under interleaved zero bubble (two chunks) and ZB-H1 (one), and
the one-way time of a boundary message (ping-pong between ranks 0 and 1), shared among the
ranks so all search alike.

After one warm-up step each, the schedules take turns step by step (the order rotating every
round, every step between barriers); reported are the median step times, the searched
schedule's ratio to each named one (median of the per-round ratios), the simulator's
prediction for each schedule from the measured costs, and the first step's loss of every
schedule (the same weights and data, so equal within 1e-5).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness import cli, report
from harness.models import same_weights, step_microbatches
from harness.pairing import take_turns
from harness.ratios import max_relative_diff, median_ratio
from harness.settings import Settings
from megapipe.models import build_model_chunks
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.schedules.analysis.schedule_search import search_schedule
from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.schedules.analysis.timeline import Timeline
from megapipe.schedules.actions import ActionKind
from megapipe.schedules.catalog import build_schedule
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

NAMED = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("interleaved", 2), ("interleaved-zb", 2)]
MEASURED_UNDER = {1: "zb-h1", 2: "interleaved-zb"}  # split-backward runs whose timelines give the costs
SLOW = 1.5
LOSS_TOLERANCE = 1e-5


@dataclass(frozen=True)
class EmulatedSettings(Settings):
    """A small GPT (tied embeddings) whose stages' costs come from ``EmulatedCosts``."""

    num_layers: int = 8
    hidden_size: int = 64
    seq_length: int = 32
    vocab_size: int = 128
    num_microbatches: int = 4
    rounds: int = 8
    tied: bool = True
    pass_ms: float = 40.0
    slow_rank: int = 1


class EmulatedCosts:
    """The artificial delay of the module docstring, put in front of the executor's compute."""

    def __init__(self, settings: EmulatedSettings, rank: int, v: int):
        factor = SLOW if rank == settings.slow_rank else 1.0
        self.seconds = settings.pass_ms / 1e3 * factor / v

    def install(self, engine: PipelineEngine) -> None:
        compute = engine.executor._compute

        def delayed(action, *args):
            if action.kind.is_compute:
                time.sleep(self.seconds * (2 if action.kind is ActionKind.B else 1))
            return compute(action, *args)

        engine.executor._compute = delayed


class Run:
    """One schedule's engine on this rank, over its own copy of the weights."""

    def __init__(self, settings: EmulatedSettings, ps: ParallelState, chunks, schedule, v: int):
        self.timeline = Timeline()
        self.engine = PipelineEngine(chunks, ps, OptimizerConfig(optimizer="sgd", lr=1e-3, clip_grad=0.0), schedule,
                                     settings.num_microbatches, settings.activation_shape, timeline=self.timeline)
        EmulatedCosts(settings, ps.pp_rank, v).install(self.engine)

    def step(self, settings: EmulatedSettings, step: int) -> tuple[float, list[float]]:
        dist.barrier()
        start = time.perf_counter()
        losses = self.engine.train_batch(step_microbatches(settings, step)).losses
        dist.barrier()
        return time.perf_counter() - start, losses


def measured_latency(settings: EmulatedSettings) -> float:
    """One-way time of a stage-boundary message between ranks 0 and 1 (median of 20 ping-pongs), on all ranks."""
    message = torch.zeros(settings.seq_length * settings.micro_batch_size * settings.hidden_size)
    trips = []
    for _ in range(20):
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(message, 1)
            dist.recv(message, 1)
        elif dist.get_rank() == 1:
            dist.recv(message, 0)
            dist.send(message, 0)
        trips.append((time.perf_counter() - start) / 2)
    latency = [statistics.median(trips)]
    dist.broadcast_object_list(latency, src=0)
    return latency[0]


def measured_costs(run: Run, p: int, v: int, latency: float) -> CostModel:
    """Per-rank medians of F, BI and BW (all chunks) from this rank's timeline, shared by all ranks."""
    durations: dict = {}
    for event in run.timeline.events:
        if event.action.kind in (ActionKind.F, ActionKind.BI, ActionKind.BW):
            durations.setdefault((event.action.kind, event.action.stage), []).append(event.end - event.start)
    mine = [sum(statistics.median(durations[(kind, s)]) for s in range(dist.get_rank(), p * v, p))
            for kind in (ActionKind.F, ActionKind.BI, ActionKind.BW)]
    everyone = [None] * p
    dist.all_gather_object(everyone, mine)
    forward, input_backward, weight_backward = ([rank[k] for rank in everyone] for k in range(3))
    return CostModel.per_rank(p, v, forward, input_backward, weight_backward, latency=latency)


def world(rank: int, p: int, settings: EmulatedSettings) -> dict:
    states = {v: ParallelState.initialize(pipeline=p, virtual_pipeline=v) for v in (1, 2)}
    config = settings.model_config()
    first = {v: build_model_chunks("gpt", config, states[v]) for v in (1, 2)}

    def chunks(v):  # the same initial weights for every schedule of v chunks
        return same_weights(config, states[v], first[v])

    latency = measured_latency(settings)
    runs = {name: Run(settings, states[v], chunks(v), name, v) for name, v in NAMED}
    first_losses = {name: run.step(settings, 0)[1] for name, run in runs.items()}
    costs, searched = {}, {}
    for v, name in MEASURED_UNDER.items():
        runs[name].step(settings, 1)  # a second step, recorded on a warm process
        costs[v] = measured_costs(runs[name], p, v, latency)
        found = search_schedule(p, settings.num_microbatches, costs[v], memory_limit=p, v=v)
        searched[v] = found
        runs[f"auto v={v}"] = Run(settings, states[v], chunks(v), found.schedule, v)
        first_losses[f"auto v={v}"] = runs[f"auto v={v}"].step(settings, 0)[1]
    times = take_turns(runs, settings.rounds, lambda name, r: runs[name].step(settings, 2 + r)[0])
    predicted = {name: float(simulate(build_schedule(name, p, settings.num_microbatches, v).compute_only(),
                                      costs[v]).makespan) for name, v in NAMED}
    predicted.update({f"auto v={v}": float(found.simulation.makespan) for v, found in searched.items()})
    peaks = {f"auto v={v}": float(max(found.simulation.peak_activations)) for v, found in searched.items()}
    return {"times": times, "losses": first_losses, "predicted": predicted, "peaks": peaks,
            "costs": {v: [float(c) for c in costs[v].forward] for v in costs}, "latency": latency}


def main(argv=None) -> int:
    parser = cli.parser(__doc__, rounds=EmulatedSettings.rounds)
    parser.add_argument("--pipeline-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=EmulatedSettings.num_microbatches)
    parser.add_argument("--pass-ms", type=float, default=EmulatedSettings.pass_ms)
    parser.add_argument("--slow-rank", type=int, default=EmulatedSettings.slow_rank)
    args = parser.parse_args(argv)
    settings = EmulatedSettings(num_microbatches=args.microbatches, pass_ms=args.pass_ms, slow_rank=args.slow_rank,
                                rounds=args.rounds)
    p = args.pipeline_size
    print(f"p={p}, m={settings.num_microbatches}; emulated stage costs (artificial delay): {settings.pass_ms:g} ms per "
          f"F, BI and BW of a whole stage, rank {settings.slow_rank} {SLOW}x slower; GPT {settings.num_layers} layers "
          f"h={settings.hidden_size}; {settings.rounds} rounds; {report.machine()}")
    results = run_distributed(p, world, settings, timeout=3600, collective_timeout=600)
    last = results[p - 1]  # the last rank holds the losses
    times = {name: statistics.median(t) for name, t in results[0]["times"].items()}
    rows = []
    for name in sorted(times, key=times.get):
        v = 2 if name.endswith("v=2") or name in ("interleaved", "interleaved-zb") else 1
        searched = "; ".join(f"{auto}: {median_ratio(results[0]['times'][auto], results[0]['times'][name]):.3f}"
                             for auto in (f"auto v={w}" for w in (1, 2)))
        rows.append([name, v, f"{times[name]:.3f}", f"{results[0]['predicted'][name]:.3f}", searched,
                     f"{last['losses'][name][0]:.6f}"])
    report.print_markdown(["schedule", "v", "median s/step", "predicted s/step (simulator, measured costs)",
                           "searched (same v) / this: median of rounds", "step-0 loss"], rows)
    print(f"\nsearched schedules' peak activations (microbatches per rank, limit {p}): {results[0]['peaks']}")
    print(f"measured forward per stage (s): {results[0]['costs']}; message latency {results[0]['latency']:.2e} s")
    print(f"load average at the end: {report.load_average()}")
    bad = []
    for v in (1, 2):
        group = [name for name, w in NAMED if w == v] + [f"auto v={v}"]
        reference = last["losses"][group[0]]
        bad += [name for name in group if max_relative_diff(last["losses"][name], reference) > LOSS_TOLERANCE]
    if bad:
        print(f"FAILED: first-step losses differ beyond {LOSS_TOLERANCE} relative for {bad}")
        return 1
    print(f"first-step losses equal within {LOSS_TOLERANCE} relative among the schedules of each v")
    return 0


if __name__ == "__main__":
    sys.exit(main())
