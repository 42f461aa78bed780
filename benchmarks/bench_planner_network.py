"""The planner on a real two-level network: 2 hosts x 2 ranks, a shaped link between the hosts at
several bandwidths, every layout of a small GPT predicted and trained (root, Linux).

    python benchmarks/bench_planner_network.py                       # about 10 minutes on 2 busy cores
    python benchmarks/bench_planner_network.py --rates-mbit 50 1000  # other link speeds

1. Profile the GPT once and calibrate this machine with 4 processes on one host, exactly as
   ``bench_planner_vs_measured.py`` does (a fitted gloo link for the ranks inside a host, each
   process's compute speed and the cores the 4 share). The GPT is small in weights and long in
   sequence (h=128, s=256), so that what data parallelism sends (its weights) and what the
   pipeline sends (its activations) are within a few times of each other.
2. For each rate, make the two hosts and measure the link between them (gloo messages and
   2-member all-reduces between one rank on each host: on this machine the kernel's packet
   work shares the 2 busy cores, so a fast shaped link delivers below its rate), then describe the machine as the planner's two-level cluster: 2 nodes of 2 devices,
   the fitted link inside a node, and between nodes one uplink per node of the fitted
   bandwidth, shared by the flows leaving a node at once (``Cluster.node_uplink_bandwidth``).
   Plan over every layout (t, p, d) of 4 devices at micro-batch 2 under 1F1B, and run
   PipeDream's hierarchical partitioner.
3. Make two test hosts (network namespaces) joined by ``tc`` links of that rate and train every
   layout for real, 2 ranks per host (``bench_planner_vs_measured.train_layouts``: all engines
   built and warmed up, then every round times one step of each layout between barriers;
   median over rounds).
4. Print predicted and measured samples/s side by side, their Spearman rank correlation, the
   planner's first choice against the measured best, and the partitioner's choice (one stage
   replicated 4 times, i.e. data parallelism, or stages split between the hosts) next to which
   of data parallelism (1, 1, 4) and the 2-stage pipeline across hosts (1, 2, 2) measured faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace

import torch

import bench_planner_vs_measured
from bench_planner_vs_measured import GLOBAL_BATCH, calibrate, describe_machine, profile_once, spearman, train_layouts
from megapipe.config import ModelConfig
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import CostModel, Layout, Training
from megapipe.planner.pipedream import partition_profile
from megapipe.planner.plan import PlanRequest, plan
from megapipe.planner.units import human_bytes
from megapipe.testing import run_distributed
from megapipe.testing_hosts import TestHosts

HOSTS, PER_HOST = 2, 2
MICRO_BATCH = 2
MODEL = dict(bench_planner_vs_measured.MODEL, hidden_size=128, num_attention_heads=4, seq_length=256, vocab_size=1024)
bench_planner_vs_measured.MODEL = MODEL  # its calibration probes this model's block
LINK_SIZES = [2 ** k for k in range(14, 23, 2)]  # 16 KiB to 4 MiB
LAYOUTS = [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]  # every (t, p, d) of 4 devices


def fit_inter_host_link(hosts) -> tuple[float, float, float]:
    """(latency, bandwidth, reduce bandwidth) between the hosts, from gloo messages and 2-member all-reduces
    between one rank on each: the bandwidths are the slopes between the two largest sizes (a shaped
    link lets small messages through at full speed from its burst, so a fit over all sizes would
    overrate it), the latency what the smallest size takes beyond its bytes."""
    messages, reductions, _ = run_distributed(HOSTS, calibrate, LINK_SIZES, 3, MODEL, 1, hosts=hosts)[0]
    span = LINK_SIZES[-1] - LINK_SIZES[-2]
    bandwidth = span / (messages[-1] - messages[-2])
    reduce_bandwidth = span / (reductions[-1] - reductions[-2])  # a 2-member ring moves its bytes over each link
    latency = max(0.0, messages[0] - LINK_SIZES[0] / bandwidth)
    print("between the hosts: " + ", ".join(f"{human_bytes(size)}: send {1e3 * a:.1f} ms, all-reduce {1e3 * b:.1f} ms"
                                            for size, a, b in zip(LINK_SIZES, messages, reductions)))
    print(f"fitted: {latency * 1e3:.2f} ms per message, {bandwidth / 1e6:.1f} MB/s for messages, "
          f"{reduce_bandwidth / 1e6:.1f} MB/s in all-reduces")
    return latency, bandwidth, reduce_bandwidth


def two_level(flat: Cluster, rate_mbit: float, link: tuple[float, float, float]) -> Cluster:
    """The calibrated single-node machine as 2 nodes of 2, joined by the fitted inter-host link."""
    latency, bandwidth, reduce_bandwidth = link
    return replace(flat, nodes=HOSTS, gpus_per_node=PER_HOST, inter_node_bandwidth=bandwidth / PER_HOST,
                   node_uplink_bandwidth=bandwidth, inter_node_latency=latency,
                   inter_node_reduce_bandwidth=reduce_bandwidth, backend="gloo",
                   name=f"2 hosts x 2, {rate_mbit:g} Mbit/s between them")


def as_bench_layout(t: int, p: int, d: int) -> tuple:
    return (t, p, d, MICRO_BATCH, "1f1b", 1, False)


def partitioner_choice(profile, cluster: Cluster) -> str:
    partition = partition_profile(profile, cluster, MICRO_BATCH, Training(GLOBAL_BATCH), limit_memory=False)
    stages = ", ".join(f"blocks {s.start}-{s.end - 1} x{s.replicas}" for s in partition.stages)
    kind = "data parallel" if len(partition.stages) == 1 else "pipeline"
    return f"{partition.config_name} ({kind}: {stages})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates-mbit", type=float, nargs="+", default=[20, 100, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(1)
    profile = profile_once(ModelConfig(**MODEL), cores)
    flat = describe_machine(profile, cores)
    layouts = [as_bench_layout(*tpd) for tpd in LAYOUTS]
    request = PlanRequest(GLOBAL_BATCH, schedules=("1f1b",), micro_batch_sizes=(MICRO_BATCH,), recompute=(False,),
                          shardings=("no_shard",))
    print("PipeDream's partitioner on this profile, 2 nodes x 2, over node uplinks of (MB/s): " + ", ".join(
        f"{mb:g}: {partitioner_choice(profile, two_level(flat, 8 * mb, (flat.intra_node_latency, mb * 1e6, mb * 1e6)))}"
        for mb in (1, 3, 10, 30, 100, 300, 1000, 3000)))
    summary = []
    for rate in args.rates_mbit:
        with TestHosts(HOSTS, rate_mbit=rate) as hosts:
            print(f"\n== {rate:g} Mbit/s between the hosts")
            cluster = two_level(flat, rate, fit_inter_host_link(hosts))
            model = CostModel(profile, cluster, Training(GLOBAL_BATCH))
            predicted = [model.estimate(Layout(t, p, d, MICRO_BATCH, "1f1b")).samples_per_second
                         for t, p, d in LAYOUTS]
            best = plan(profile, cluster, request).best.layout
            chosen = (best.tensor, best.pipeline, best.data)
            partitioner = partitioner_choice(profile, cluster)
            start = time.perf_counter()
            per_rank = run_distributed(HOSTS * PER_HOST, train_layouts, layouts, MODEL, args.warmup, args.rounds,
                                       hosts=hosts, timeout=3600, collective_timeout=600)
        steps = [rank[0] for rank in per_rank]
        measured = [GLOBAL_BATCH / statistics.median(max(step) for step in zip(*(rank[i] for rank in steps)))
                    for i in range(len(layouts))]
        rho = spearman(predicted, measured)
        print(f"trained {len(layouts)} layouts x {args.warmup} + {args.rounds} rounds in "
              f"{time.perf_counter() - start:.0f} s")
        print(f"{'t p d':<8} {'predicted':>10} {'measured':>9} {'/predicted':>10}   (samples/s)")
        for tpd, guess, real in sorted(zip(LAYOUTS, predicted, measured), key=lambda row: -row[2]):
            mark = "  <- planner's choice" if tpd == chosen else ""
            print(f"{' '.join(map(str, tpd)):<8} {guess:>10.2f} {real:>9.2f} {real / guess:>10.2f}{mark}")
        chosen_measured = measured[LAYOUTS.index(chosen)]
        dp, pp = measured[LAYOUTS.index((1, 1, 4))], measured[LAYOUTS.index((1, 2, 2))]
        print(f"Spearman {rho:.2f}; the planner's choice {chosen} measures {chosen_measured / max(measured):.0%} of the "
              f"measured best; PipeDream's partitioner: {partitioner}; measured: data parallel {dp:.2f}, pipeline "
              f"across hosts {pp:.2f} samples/s")
        summary.append((rate, rho, chosen, chosen_measured / max(measured), partitioner, dp, pp))
    print("\n| link | Spearman | planner's choice | its measured share of the best | PipeDream's partitioner | "
          "measured samples/s: DP (1,1,4) vs PP across hosts (1,2,2) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rate, rho, chosen, share, partitioner, dp, pp in summary:
        print(f"| {rate:g} Mbit/s | {rho:.2f} | {chosen} | {share:.0%} | {partitioner} | {dp:.2f} vs {pp:.2f} "
              f"({'PP' if pp > dp else 'DP'} faster) |")


if __name__ == "__main__":
    main()
