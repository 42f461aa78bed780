"""The planner's predictions against real training on this machine: 4 processes, a small GPT.

    python benchmarks/bench_planner_vs_measured.py            # about 5-8 minutes on 2 busy cores
    python benchmarks/bench_planner_vs_measured.py --quick    # fewer rounds and layouts

1. Profile the model once, layer by layer, in one single-threaded process.
2. Calibrate the machine with 4 processes: fit a per-message latency, a message bandwidth and
   an all-reduce bandwidth to gloo send/recv ping-pongs and 4-way all-reduces over a range of
   sizes, using the planner's own formulas (message: latency + bytes / bandwidth; ring
   all-reduce: 2 (n-1) latency + 2 (n-1)/n bytes / reduce bandwidth; gloo reduces on the
   CPU, which the busy cores make far slower than sending); and time one transformer block
   forward+backward in one process alone and in all 4 at once.
3. Describe the machine honestly as a cluster: one node of 4 devices (the processes) that
   compute, alone, at the probed speed relative to the profile, and share the cores: 4
   processes at once compute like ``shared_cores`` of them alone (nominally 2 on 2 cores;
   less when other programs run), so a batch takes at least all ranks' compute over that,
   while a rank idle in a pipeline bubble lends its core to the others; with the fitted link.
4. Plan, then train every layout for real with PipelineEngine in one world of 4 spawned
   processes (gloo, one thread each): all engines are built first and warmed up, then each
   round runs one step of every layout between barriers, so the load other programs put on
   the machine hits all layouts alike (2BW's step is a steady-state one: refilled before,
   drained after, untimed); a layout's time is the median over rounds. Print predicted and
   measured throughput side by side with the Spearman rank correlation.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from harness import cli
from harness.ratios import spearman
from megapipe.config import ModelConfig
from megapipe.models import build_model_chunks
from megapipe.models.transformer import TransformerLayer
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.schedules.catalog import schedule_descriptor
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import PlanCostModel, Candidate, Training
from megapipe.planner.plan import PlanRequest, plan
from megapipe.planner.profiler import profile_model, synthetic_batch
from megapipe.planner.units import GIB, human_bytes
from megapipe.testing.worlds import run_distributed

WORLD = 4
MODEL = dict(num_layers=8, hidden_size=256, num_attention_heads=8, vocab_size=2048, seq_length=128,
             hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True)
GLOBAL_BATCH = 16
PROBE_BATCH = 2
# (t, p, d, b, schedule, v, recompute): data, pipeline and tensor parallelism, every schedule
LAYOUTS = [
    (1, 1, 4, 2, "1f1b", 1, False),
    (1, 2, 2, 2, "1f1b", 1, False),
    (1, 4, 1, 2, "1f1b", 1, False),
    (1, 4, 1, 2, "gpipe", 1, False),
    (1, 4, 1, 2, "interleaved", 2, False),
    (1, 4, 1, 2, "2bw", 1, False),
    (2, 2, 1, 2, "1f1b", 1, False),
    (2, 1, 2, 4, "1f1b", 1, False),
    (4, 1, 1, 4, "1f1b", 1, False),
    (1, 2, 2, 4, "1f1b", 1, True),
]


# ---- what runs in the spawned processes ------------------------------------------------------
def block_probe(model: dict, batch: int = PROBE_BATCH):
    """One block's forward+backward at ``batch`` on a fixed input, as a callable."""
    config = ModelConfig(**model)
    block = TransformerLayer(config, ParallelState.single(), 0, seed=1)
    x = torch.randn(config.seq_length, batch, config.hidden_size, requires_grad=True)

    def run() -> float:
        start = time.perf_counter()
        block(x).sum().backward()
        return time.perf_counter() - start
    return run


def probe_rounds(rank, probe, rounds: int) -> tuple[list[float], list[float]]:
    """The block probe's seconds on rank 0 alone (the others wait in a barrier) and on every rank at once."""
    alone, together = [], []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            alone.append(probe())
        dist.barrier()
        together.append(probe())
    return alone, together


def one_way_seconds(rank, x: torch.Tensor, repeats: int) -> float:
    """Seconds per one-way message of ``x`` between ranks 0 and 1: half a ping-pong, averaged over ``repeats``
    (the other ranks only join the barrier)."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
    return (time.perf_counter() - start) / (2 * repeats)


def calibrate(rank, world_size, sizes, repeats, model, probes):
    """Seconds per one-way message (ranks 0 and 1) and per all-reduce (all ranks) for each size in bytes,
    and the block probe's seconds alone and when all ranks run it at once."""
    messages, reductions = [], []
    for size in sizes:
        x = torch.zeros(size // 4)
        messages.append(one_way_seconds(rank, x, repeats))
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        reductions.append((time.perf_counter() - start) / repeats)
    return messages, reductions, probe_rounds(rank, block_probe(model), probes)


def build_engine(layout, model):
    t, p, d, b, schedule, v, recompute = layout
    config = ModelConfig(**model, **(dict(recompute_granularity="full", recompute_method="uniform",
                                          recompute_num_layers=1) if recompute else {}))
    ps = ParallelState.initialize(tensor=t, pipeline=p, virtual_pipeline=v, placement=schedule_descriptor(schedule).placement)
    ps.seed(1234, torch.device("cpu"))
    chunks = build_model_chunks("gpt", config, ps)
    m = GLOBAL_BATCH // (d * b)
    engine = PipelineEngine(chunks, ps, OptimizerConfig(optimizer="adam", lr=1e-4), schedule, m,
                            (config.seq_length, b, config.hidden_size), timeout=datetime.timedelta(seconds=600))
    batches = [synthetic_batch("gpt", config, b, torch.device("cpu"), seed=1000 * ps.dp_rank + i) for i in range(m)]
    return engine, batches


def train_layouts(rank, world_size, layouts, model, warmup, rounds):
    """Per layout, this rank's step times, and block probes alone and together (``probe_rounds``), one per
    round: every round runs one timed step of each layout, between barriers.

    An asynchronous pipeline (2BW, PipeDream) stays full between its steps, with messages in
    flight; before another layout runs it is drained (untimed) and, next round, refilled by an
    untimed step, so the timed step is a steady-state one.
    """
    engines = [build_engine(layout, model) for layout in layouts]
    times = [[] for _ in layouts]
    probe, alone, together = block_probe(model), [], []
    for round_index in range(warmup + rounds):
        lone, crowd = probe_rounds(rank, probe, 1)
        alone += lone
        together += crowd
        for index, ((engine, batches), layout) in enumerate(zip(engines, layouts)):
            asynchronous = schedule_descriptor(layout[4]).asynchronous
            if asynchronous:
                engine.train_batch(batches)
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(batches)
            dist.barrier()
            if round_index >= warmup:
                times[index].append(time.perf_counter() - start)
            if asynchronous:
                engine.drain()
    return times, alone, together


# ---- the benchmark ----------------------------------------------------------------------------
def fit_links(sizes, messages, reductions, n=WORLD) -> tuple[float, float, float, float]:
    """Least squares on relative errors of the planner's formulas: (latency, bandwidth, reduce bandwidth,
    worst relative misfit). A message takes latency + bytes / bandwidth, a ring all-reduce
    2 (n-1) latency + 2 (n-1)/n bytes / reduce bandwidth."""
    rows, times = [], []
    for size, message, reduction in zip(sizes, messages, reductions):
        rows += [[1.0, size, 0.0], [2 * (n - 1), 0.0, 2 * (n - 1) / n * size]]
        times += [message, reduction]
    rows, times = np.array(rows), np.array(times)
    solution, *_ = np.linalg.lstsq(rows / times[:, None], np.ones(len(times)), rcond=None)
    solution = np.maximum(solution, [0.0, 1e-15, 1e-15])
    worst = float(np.max(np.abs(rows @ solution / times - 1)))
    return float(solution[0]), 1.0 / solution[1], 1.0 / solution[2], worst


def machine_speed(block_time: float, alone: list[float], together: list[float]) -> tuple[float, float]:
    """(compute speed of one process relative to the profile, devices' worth of cores the WORLD processes share)."""
    lone, crowd = statistics.median(alone), statistics.median(together)
    return block_time / lone, min(float(WORLD), WORLD * lone / crowd)


def describe(layout) -> str:
    return Candidate(*layout[:5], virtual=layout[5], recompute=layout[6]).describe()


def profile_once(config: ModelConfig, cores: int):
    start = time.perf_counter()
    profile = profile_model("gpt", config, (1, 2, 4, 8), iterations=8, warmup=2)
    block = profile.layers[1]
    print(f"GPT: {config.num_layers} layers, h={config.hidden_size}, s={config.seq_length}, V={config.vocab_size}; "
          f"global batch {GLOBAL_BATCH}; {WORLD} processes on {cores} cores")
    print(f"profile ({time.perf_counter() - start:.0f} s, one thread): a block takes "
          + ", ".join(f"b={b}: {1e3 * (f + bw):.1f} ms" for b, f, bw in
                      zip(profile.micro_batch_sizes, block.forward_s, block.backward_s))
          + " forward+backward")
    return profile


def describe_machine(profile, cores: int) -> Cluster:
    """Calibrate links and compute sharing with WORLD processes; the cluster the planner is given."""
    sizes = [2 ** k for k in range(12, 25, 2)]
    messages, reductions, (alone, together) = run_distributed(WORLD, calibrate, sizes, 20, MODEL, 10)[0]
    latency, bandwidth, reduce_bandwidth, worst = fit_links(sizes, messages, reductions)
    print("gloo, " + ", ".join(f"{human_bytes(size)}: send {1e3 * a:.2f} ms, all-reduce {1e3 * b:.2f} ms"
                               for size, a, b in zip(sizes, messages, reductions)))
    print(f"fitted link: {latency * 1e6:.0f} us per message or all-reduce step, {bandwidth / 1e9:.2f} GB/s for "
          f"messages, {reduce_bandwidth / 1e9:.2f} GB/s in all-reduces (worst relative misfit {worst:.0%})")
    block_time = probe_time(profile)
    speed, cores_worth = machine_speed(block_time, alone, together)
    print(f"a block at b={PROBE_BATCH}: {1e3 * block_time:.1f} ms in the profile, {1e3 * statistics.median(alone):.1f} ms "
          f"alone now, {1e3 * statistics.median(together):.1f} ms in {WORLD} processes at once")
    print(f"model of the machine: one node of {WORLD} devices (processes) computing at {speed:.2f}x the profile "
          f"alone and sharing {cores_worth:.2f} devices' worth of cores ({cores} cores, other programs running; "
          f"a batch takes at least all ranks' compute over that), linked by the fitted gloo link, stepping Adam at "
          "the profiled seconds per parameter; the executor's Python overhead is not modelled.")
    return Cluster(nodes=1, gpus_per_node=WORLD, memory_per_gpu=8 * GIB, intra_node_bandwidth=bandwidth,
                   inter_node_bandwidth=bandwidth, intra_node_latency=latency, inter_node_latency=latency,
                   intra_node_reduce_bandwidth=reduce_bandwidth, compute_speed=speed, shared_cores=cores_worth,
                   name=f"this machine, {WORLD} processes")


def probe_time(profile) -> float:
    costs = profile.costs(PROBE_BATCH)
    return float(costs.forward[1] + costs.backward[1])


def predict(profile, cluster: Cluster, layouts) -> list[float]:
    model = PlanCostModel(profile, cluster, Training(GLOBAL_BATCH))
    return [model.estimate(Candidate(*layout[:5], virtual=layout[5], recompute=layout[6])).samples_per_second
            for layout in layouts]


def print_comparison(layouts, predicted, again, measured, chosen) -> None:
    rows = sorted(zip(layouts, predicted, again, measured), key=lambda row: -row[3])
    print(f"\n{'layout (samples/s)':<52} {'predicted':>10} {'during':>8} {'measured':>9} {'/predicted':>11} "
          f"{'/during':>8}")
    for layout, guess, later, real in rows:
        mark = "  <- planner's choice" if layout == chosen else ""
        print(f"{describe(layout):<52} {guess:>10.2f} {later:>8.2f} {real:>9.2f} {real / guess:>11.2f} "
              f"{real / later:>8.2f}{mark}")
    best_measured = max(measured)
    chosen_measured = measured[layouts.index(chosen)]
    print(f"\nSpearman rank correlation of predicted and measured: {spearman(predicted, measured):.2f} "
          f"({spearman(again, measured):.2f} with the machine as probed during the runs) over {len(rows)} layouts")
    print(f"planner's choice measures {chosen_measured:.2f} samples/s, {chosen_measured / best_measured:.0%} of the "
          f"measured best ({best_measured:.2f})")


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="3 rounds and 6 layouts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    layouts = LAYOUTS[:6] if args.quick else LAYOUTS
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(1)

    profile = profile_once(ModelConfig(**MODEL), cores)
    cluster = describe_machine(profile, cores)
    first = plan(profile, cluster, PlanRequest(GLOBAL_BATCH, max_micro_batch_size=8)).best.candidate
    chosen = (first.tensor, first.pipeline, first.data, first.micro_batch_size, first.schedule, first.virtual,
              first.recompute)
    print(f"planner's first choice: {first.describe()}")
    if chosen not in layouts:
        layouts = [chosen] + layouts
    predicted = predict(profile, cluster, layouts)

    start = time.perf_counter()
    per_rank = run_distributed(WORLD, train_layouts, layouts, MODEL, args.warmup, rounds, timeout=3600)
    steps = [rank[0] for rank in per_rank]
    measured = [GLOBAL_BATCH / statistics.median(max(step) for step in zip(*(rank[i] for rank in steps)))
                for i in range(len(layouts))]
    print(f"trained {len(layouts)} layouts for {args.warmup} + {rounds} rounds in {time.perf_counter() - start:.0f} s")
    speed, cores_worth = machine_speed(probe_time(profile), per_rank[0][1], per_rank[0][2])
    print(f"during the runs the probe gave speed {speed:.2f} and {cores_worth:.2f} devices' worth of cores: the "
          "'during' column predicts with those")
    again = predict(profile, replace(cluster, compute_speed=speed, shared_cores=cores_worth), layouts)
    print_comparison(layouts, predicted, again, measured, chosen)


if __name__ == "__main__":
    main()
