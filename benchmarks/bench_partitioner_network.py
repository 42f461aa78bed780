"""PipeDream's partitioner on a real link: replicate the model or pipeline it, as the bandwidth between
2 hosts changes, and the choice checked by training every candidate (root, Linux).

    python benchmarks/bench_partitioner_network.py                        # about 6 minutes on 2 busy cores
    python benchmarks/bench_partitioner_network.py --rates-mbit 10 50 1000

Seed 002's partitioner (section 2.4.1) replicates a stage when the time to synchronise its weights,
2 (m - 1) |w| / B, is below the compute the replicas share, and cuts the model into a pipeline when
the activations it would send, 2 |a| / B per input, cost less than that. Which one wins moves with
the bandwidth B between the workers only where the two are close, and on this machine the links
reach a few tens of MB/s at most (``bench_planner_network.py``), so the model is chosen for it:

* a long sequence (s = 2048) and a small hidden size (h = 32) with an output layer over a large
  vocabulary (V = 32768, untied): the output layer's compute grows with the sequence while its
  weights do not, so the model computes about a second per sample for 8 MB of weights, which puts
  the bandwidth at which synchronising those weights costs as much as the compute near 8 MB/s,
  between the links shaped to 20 and 100 Mbit/s; its activations, 256 KiB per sample, are 1/32 of
  the weights, so at low bandwidth the pipeline sends far less;
* 4 thin blocks (rotary positions, so no position table adds weights): the output layer is most of
  the compute, so no split into two stages balances, and with a fast link replicating the whole
  model (each worker computes half the samples) beats a pipeline whose last stage does most of the
  work. That imbalance is what makes replication worth its synchronisation; a model of equal
  layers splits evenly and the two tie once the link is fast.

2 hosts (network namespaces) of 1 rank each, so that each process has a core of its own. For each
rate: measure the link between the hosts (one gloo flow, the slope of the two largest sizes), give
the partitioner a cluster of 2 nodes x 1 device with that link and the processes' measured compute
speed, and train every candidate with PipeDream (weight stashing, an update after every input, as
the partitioner assumes): the model replicated on both hosts ("2") and each split into two stages
("1-1", blocks i | rest); one round times two steady-state steps of each candidate between barriers,
the median over rounds is printed as samples/s next to the partitioner's time per input.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

from harness import cli
from harness.report import print_markdown
from bench_planner_network import LINK_SIZES, slope
from bench_planner_vs_measured import block_probe, one_way_seconds, probe_rounds
from megapipe.config import ModelConfig
from megapipe.models import build_model_chunks
from megapipe.optim import OptimizerConfig
from megapipe.pipeline.engine import PipelineEngine
from megapipe.parallel.state import ParallelState
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import Training
from megapipe.planner.profile_partition import partition_profile
from megapipe.planner.profiler import profile_model, synthetic_batch
from megapipe.planner.units import GIB, human_bytes
from megapipe.layout.stage_plan import StagePlan
from megapipe.testing.worlds import run_distributed
from megapipe.testing.hosts import TestHosts

MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=2, seq_length=2048, vocab_size=32768,
             position_embedding_type="rope", untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
             attention_dropout=0.0)
HOSTS = 2
MICRO_BATCH = 1
STEPS = 2  # timed steps per candidate and round


def candidates(num_layers: int) -> list[StagePlan]:
    """The model replicated on both workers, and every split into two stages."""
    return [StagePlan.parse(f"0:{num_layers}x2")] + [StagePlan.parse(f"0:{cut},{cut}:{num_layers}")
                                                   for cut in range(1, num_layers)]


def describe(plan: StagePlan) -> str:
    if plan.num_stages == 1:
        return "2 (replicated)"
    return "1-1 (blocks " + " | ".join(f"{s.layer_start}-{s.layer_end - 1}" for s in plan.stages) + ")"


def as_plan(partition) -> StagePlan:
    return StagePlan.parse(",".join(f"{s.start}:{s.end}x{s.replicas}" for s in partition.stages))


# ---- what runs in the spawned processes ------------------------------------------------------
def probe_host(rank, world_size, sizes, repeats, model, probes):
    """Seconds per one-way message between the hosts (half a ping-pong) for each size, and one block's
    forward+backward alone and on both ranks at once (``probe_rounds``)."""
    times = [one_way_seconds(rank, torch.zeros(size // 4), repeats) for size in sizes]
    return times, probe_rounds(rank, block_probe(model, MICRO_BATCH), probes)


def inputs_per_step(plan: StagePlan) -> int:
    """Microbatches per call: 1F1B-RR sends microbatch i to replica i % R of the input stage, so one
    per replica keeps every replica busy in each step."""
    return plan.stages[0].replicas


def train_plans(rank, world_size, plans, model, warmup, rounds):
    """Per plan, this rank's seconds for STEPS steady-state PipeDream steps, one entry per round."""
    config = ModelConfig(**model)
    runs = []
    for plan in plans:
        ps = ParallelState.initialize(plan=plan)
        ps.seed(1234, torch.device("cpu"))
        chunks = build_model_chunks("gpt", config, ps, plan.layer_ranges)
        m = inputs_per_step(plan)
        engine = PipelineEngine(chunks, ps, OptimizerConfig(optimizer="adam", lr=1e-4), "pipedream", m,
                                (config.seq_length, MICRO_BATCH, config.hidden_size),
                                timeout=datetime.timedelta(seconds=600))
        batches = [[synthetic_batch("gpt", config, MICRO_BATCH, torch.device("cpu"), seed=10 * step + i)
                    for i in range(m)] for step in range(STEPS + 1)]
        runs.append((engine, batches))
    times = [[] for _ in plans]
    for round_index in range(warmup + rounds):
        for index, (engine, batches) in enumerate(runs):
            engine.train_batch(batches[0])  # refill the pipeline: the timed steps are steady-state ones
            dist.barrier()
            start = time.perf_counter()
            for step in range(STEPS):
                engine.train_batch(batches[1 + step])
            dist.barrier()
            if round_index >= warmup:
                times[index].append(time.perf_counter() - start)
            engine.drain()
    return times


# ---- the benchmark ----------------------------------------------------------------------------
def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--rates-mbit", type=float, nargs="+", default=[20, 100, 1000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = ModelConfig(**MODEL)
    start = time.perf_counter()
    profile = profile_model("gpt", config, (MICRO_BATCH,), iterations=3, warmup=1)
    costs = profile.costs(MICRO_BATCH)
    weights, activation = float(costs.params.sum()) * 4, float(costs.output_bytes[1])
    compute = float((costs.forward + costs.backward).sum())
    print(f"GPT: {config.num_layers} blocks, h={config.hidden_size}, s={config.seq_length}, V={config.vocab_size}, "
          f"untied; {human_bytes(weights)} of fp32 weights, {human_bytes(activation)} of activations per sample; "
          f"profile ({time.perf_counter() - start:.0f} s, one thread): " + ", ".join(
              f"{name} {1e3 * (f + b):.0f} ms" for name, f, b in zip(
                  ("embedding",) + tuple(f"block {i}" for i in range(config.num_layers)) + ("head",),
                  costs.forward, costs.backward)) + f" forward+backward per sample, {compute:.2f} s in all")
    plans = candidates(config.num_layers)
    summary = []
    for rate in args.rates_mbit:
        with TestHosts(HOSTS, rate_mbit=rate) as hosts:
            print(f"\n== {rate:g} Mbit/s between the hosts")
            times, (alone, together) = run_distributed(HOSTS, probe_host, LINK_SIZES, 3, MODEL, 5, hosts=hosts,
                                                       timeout=1200)[0]
            bandwidth = slope(LINK_SIZES, times)
            speed = float(costs.forward[1] + costs.backward[1]) / statistics.median(together)
            print("one flow: " + ", ".join(f"{human_bytes(s)} {1e3 * t:.1f} ms" for s, t in zip(LINK_SIZES, times))
                  + f"; fitted {bandwidth / 1e6:.1f} MB/s; a block takes {1e3 * statistics.median(alone):.0f} ms "
                  f"alone, {1e3 * statistics.median(together):.0f} ms on both ranks at once: speed {speed:.2f}")
            cluster = Cluster(nodes=HOSTS, gpus_per_node=1, memory_per_gpu=8 * GIB, intra_node_bandwidth=bandwidth,
                              inter_node_bandwidth=bandwidth, compute_speed=speed, backend="gloo",
                              name=f"2 hosts x 1, {rate:g} Mbit/s")
            partition = partition_profile(profile, cluster, MICRO_BATCH, Training(HOSTS), limit_memory=False)
            choice = as_plan(partition)
            per_rank = run_distributed(HOSTS, train_plans, plans, MODEL, args.warmup, args.rounds, hosts=hosts,
                                       timeout=3600, collective_timeout=600)
        samples = [STEPS * MICRO_BATCH * inputs_per_step(plan) for plan in plans]
        measured = [count / statistics.median(max(pair) for pair in zip(*(rank[i] for rank in per_rank)))
                    for i, count in enumerate(samples)]
        print(f"load average {os.getloadavg()[0]:.1f}; partitioner: {describe(choice)}, "
              f"{1e3 * partition.time_per_input:.0f} ms per input predicted "
              f"({1 / partition.time_per_input:.2f} samples/s)")
        best = max(range(len(plans)), key=lambda i: measured[i])
        for plan, value in zip(plans, measured):
            marks = [label for label, hit in (("partitioner's choice", plan == choice), ("measured best",
                     plan == plans[best])) if hit]
            print(f"  {describe(plan):<28} {value:6.2f} samples/s measured" + (f"  <- {', '.join(marks)}"
                                                                             if marks else ""))
        chosen = measured[plans.index(choice)] if choice in plans else float("nan")
        summary.append((rate, bandwidth, choice, chosen / measured[best], plans[best], measured[0],
                        max(measured[1:])))
    print_markdown(["link", "measured MB/s", "partitioner's choice", "its measured share of the best", "measured best",
                    "measured samples/s: replicated vs best pipeline"],
                   [[f"{rate:g} Mbit/s", f"{bandwidth / 1e6:.1f}", describe(choice), f"{share:.0%}", describe(best),
                     f"{replicated:.2f} vs {pipelined:.2f}"]
                    for rate, bandwidth, choice, share, best, replicated, pipelined in summary])

if __name__ == "__main__":
    main()
