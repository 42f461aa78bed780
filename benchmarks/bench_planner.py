"""How fast the planner runs and what it picks for the seeds' big GPTs on 64 GPUs.

    python benchmarks/bench_planner.py

1. PipeDream's partitioner on 100 layers over 2 levels of 8 x 8 = 64 workers (seed 002 reports
   under 8 seconds): the paper's problem, and the same with a per-device memory limit.
2. Plans for GPT 1.3B, 2.2B and 3.8B (closed-form profiles, s = 512) on 8 nodes of 8 V100 16 GB
   (the 2BW evaluation's machines) and of 8 A100 80 GB, global batch 512: the best layout over
   everything, and within 2BW's own search space (tensor size 1), where the seeds report
   8-deep pipelines for 2.2B and 16-deep for 3.8B.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from harness import cli
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.partition import Level, PartitionProblem, StageMemory, partition
from megapipe.planner.plan import PlanRequest, plan
from megapipe.planner.presets import CLUSTERS, MODELS, parameter_count
from megapipe.planner.units import human_bytes


def timed(function, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def partitioner_runtime() -> None:
    rng = np.random.default_rng(0)
    n = 100
    compute = rng.uniform(1e-3, 2e-3, n)
    activations = rng.uniform(1e6, 8e6, n)
    weights = rng.uniform(1e6, 2e7, n)
    levels = [Level(8, 1e11), Level(8, 3e9)]
    print("PipeDream partitioner, 100 layers, 2 levels (8 x 8 = 64 workers), median of 3 runs:")
    seconds, result = timed(lambda: partition(PartitionProblem(compute, activations, weights, levels)), 3)
    print(f"  paper's problem:       {seconds:7.3f} s  config {result.config_name}, "
          f"{result.time_per_input * 1e3:.3f} ms per input, NOAM {result.noam}")
    # 16-bit weight versions, 16 bytes of gradients and optimizer state per parameter, stashes of 10
    # outputs; the limit is 80% of what the unconstrained partition needs on its fullest device.
    version, state, stash = weights / 2, weights * 8, activations * 10
    need = max(s.in_flight * (version[s.start:s.end].sum() + stash[s.start:s.end].sum()) + state[s.start:s.end].sum()
               for s in result.stages)
    memory = StageMemory(version, state, stash, capacity=0.8 * need)
    seconds, limited = timed(lambda: partition(PartitionProblem(compute, activations, weights, levels, memory)), 3)
    print(f"  with a memory limit:   {seconds:7.3f} s  config {limited.config_name}, "
          f"{limited.time_per_input * 1e3:.3f} ms per input, NOAM {limited.noam} "
          f"(limit {human_bytes(memory.capacity)}, unconstrained needs {human_bytes(need)})")
    flat = [Level(64, 1e11)]
    seconds, result = timed(lambda: partition(PartitionProblem(compute, activations, weights, flat)), 3)
    print(f"  one level of 64:       {seconds:7.3f} s  config {result.config_name}")


def big_gpt_plans() -> None:
    print("\nPlans for global batch 512 (closed-form profiles; seconds to plan in brackets):")
    for cluster_name in ("v100-16gb-8x8", "a100-80gb-8x8"):
        cluster = CLUSTERS[cluster_name]
        print(f"\n{cluster.name}: {human_bytes(cluster.usable_memory)} usable per device, "
              f"{cluster.achieved_flops / 1e12:.0f} TFLOP/s achieved, inter-node "
              f"{cluster.inter_node_bandwidth / 1e9:.3g} GB/s per device")
        for model_name in ("gpt-1.3b", "gpt-2.2b", "gpt-3.8b"):
            shape = MODELS[model_name]
            profile = analytic_gpt_profile(shape, cluster.achieved_flops)
            start = time.perf_counter()
            result = plan(profile, cluster, PlanRequest(512))
            seconds = time.perf_counter() - start
            best = result.best
            print(f"  {model_name} ({parameter_count(shape) / 1e9:.2f}B, {shape.num_layers} layers) [{seconds:.1f} s, "
                  f"{result.evaluated} layouts, {len(result.ranked)} fit]")
            print(f"    best:        {best.candidate.describe():<52} {best.samples_per_second:7.1f} samples/s "
                  f"{best.flops_per_gpu / 1e12:5.1f} TFLOP/s {human_bytes(best.memory):>9}")
            two_bw = [e for e in result.ranked if e.candidate.schedule == "2bw" and e.candidate.tensor == 1]
            by_depth = {}
            for e in two_bw:
                by_depth.setdefault(e.candidate.pipeline, e)
            depths = ", ".join(f"p={p}: {e.samples_per_second:.1f}" for p, e in sorted(by_depth.items()))
            if two_bw:
                print(f"    2BW, t = 1:  {two_bw[0].candidate.describe():<52} {two_bw[0].samples_per_second:7.1f} "
                      f"samples/s {human_bytes(two_bw[0].memory):>26}   by depth: {depths}")
            for schedule in ("1f1b", "gpipe", "interleaved", "pipedream"):
                mine = [e for e in result.ranked if e.candidate.schedule == schedule]
                if mine:
                    print(f"    best {schedule:<11} {mine[0].candidate.describe():<52} "
                          f"{mine[0].samples_per_second:7.1f} samples/s")


def main() -> None:
    cli.parser(__doc__).parse_args()
    partitioner_runtime()
    big_gpt_plans()


if __name__ == "__main__":
    main()
