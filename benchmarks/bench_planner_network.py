"""The planner on a real two-level network: 2 hosts x 2 ranks, a shaped link between the hosts at
several bandwidths, every layout of a small GPT predicted and trained (root, Linux).

    python benchmarks/bench_planner_network.py                       # about 10 minutes on 2 busy cores
    python benchmarks/bench_planner_network.py --rates-mbit 50 1000  # other link speeds

1. Profile the GPT once and calibrate this machine with 4 processes on one host, exactly as
   ``bench_planner_vs_measured.py`` does (a fitted gloo link for the ranks inside a host, each
   process's compute speed and the cores the 4 share).
2. For each rate, describe the machine as the planner's two-level cluster: 2 nodes of 2
   devices, the fitted link inside a node, and between nodes one uplink per node of the shaped
   rate's TCP payload (rate x MSS / (MSS + headers)) that the flows leaving a node at once share
   (``Cluster.node_uplink_bandwidth``). Plan over every layout (t, p, d) of 4 devices at
   micro-batch 2 under 1F1B, and run PipeDream's hierarchical partitioner.
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

from bench_planner_vs_measured import GLOBAL_BATCH, MODEL, describe_machine, profile_once, spearman, train_layouts
from megapipe.config import ModelConfig
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import CostModel, Layout, Training
from megapipe.planner.pipedream import partition_profile
from megapipe.planner.plan import PlanRequest, plan
from megapipe.planner.traffic import FRAME_OVERHEAD, MSS
from megapipe.testing import run_distributed
from megapipe.testing_hosts import TestHosts

HOSTS, PER_HOST = 2, 2
MICRO_BATCH = 2
LAYOUTS = [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]  # every (t, p, d) of 4 devices


def two_level(flat: Cluster, rate_mbit: float) -> Cluster:
    """The calibrated single-node machine as 2 nodes of 2, joined by uplinks of ``rate_mbit``'s payload."""
    payload = rate_mbit * 1e6 / 8 * MSS / (MSS + FRAME_OVERHEAD)
    return replace(flat, nodes=HOSTS, gpus_per_node=PER_HOST, inter_node_bandwidth=payload / PER_HOST,
                   node_uplink_bandwidth=payload, inter_node_reduce_bandwidth=flat.intra_node_reduce_bandwidth,
                   backend="gloo", name=f"2 hosts x 2, {rate_mbit:g} Mbit/s between them")


def as_bench_layout(t: int, p: int, d: int) -> tuple:
    return (t, p, d, MICRO_BATCH, "1f1b", 1, False)


def partitioner_choice(profile, cluster: Cluster) -> str:
    partition = partition_profile(profile, cluster, MICRO_BATCH, Training(GLOBAL_BATCH), limit_memory=False)
    stages = ", ".join(f"blocks {s.start}-{s.end - 1} x{s.replicas}" for s in partition.stages)
    kind = "data parallel" if len(partition.stages) == 1 else "pipeline"
    return f"{partition.config_name} ({kind}: {stages})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates-mbit", type=float, nargs="+", default=[50, 200, 1000])
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
    summary = []
    for rate in args.rates_mbit:
        cluster = two_level(flat, rate)
        model = CostModel(profile, cluster, Training(GLOBAL_BATCH))
        predicted = [model.estimate(Layout(t, p, d, MICRO_BATCH, "1f1b")).samples_per_second for t, p, d in LAYOUTS]
        best = plan(profile, cluster, request).best.layout
        chosen = (best.tensor, best.pipeline, best.data)
        partitioner = partitioner_choice(profile, cluster)
        start = time.perf_counter()
        with TestHosts(HOSTS, rate_mbit=rate) as hosts:
            per_rank = run_distributed(HOSTS * PER_HOST, train_layouts, layouts, MODEL, args.warmup, args.rounds,
                                       hosts=hosts, timeout=3600, collective_timeout=600)
        steps = [rank[0] for rank in per_rank]
        measured = [GLOBAL_BATCH / statistics.median(max(step) for step in zip(*(rank[i] for rank in steps)))
                    for i in range(len(layouts))]
        rho = spearman(predicted, measured)
        print(f"\n== {cluster.name}: trained {len(layouts)} layouts x {args.warmup} + {args.rounds} rounds in "
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
    print(f"\n{'link':>10} | {'Spearman':>8} | {'planner':<9} | {'of best':>7} | {'partitioner':<60} | DP vs PP measured")
    for rate, rho, chosen, share, partitioner, dp, pp in summary:
        print(f"{rate:>6g} Mb/s | {rho:>8.2f} | {' '.join(map(str, chosen)):<9} | {share:>7.0%} | {partitioner:<60} | "
              f"{dp:.2f} vs {pp:.2f} ({'PP' if pp > dp else 'DP'} faster)")


if __name__ == "__main__":
    main()
