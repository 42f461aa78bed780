"""Bytes each layout sends between hosts per iteration: the planner's traffic model next to the
interface counters of two namespaced hosts (2 hosts x 2 ranks; root, Linux).

    python benchmarks/bench_traffic.py             # about 4 minutes on 2 busy cores
    python benchmarks/bench_traffic.py --quick     # 4 layouts

Each layout trains the same GPT through the real training loop (``Trainer``: data, pipeline
schedule, gradient syncs, optimizer, logging collectives) twice in one world of 4 processes
spread over two hosts (``megapipe.testing.hosts``): once for K1 and once for K2 iterations.
The difference of the frames the hosts sent, divided by K2 - K1, is one iteration's traffic:
start-up (process groups, rendezvous, evaluation) cancels out. The prediction is
``PlanCostModel.traffic`` (``megapipe/planner/traffic.py``) for the same layout on a cluster of 2
nodes x 2 devices with gloo's collectives, put on the wire with one Ethernet + IP + TCP
header per segment. The measured payload is the counted bytes minus that header for every
counted frame (acknowledgements included), so the two columns split what the model must get
right (payload) from what the wire adds.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from harness import cli
from megapipe.cli.parse import parse_run
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import PlanCostModel, Candidate, Training
from megapipe.planner.profile import ModelShape
from megapipe.planner.traffic import FRAME_OVERHEAD, wire_bytes
from megapipe.testing.worlds import run_distributed
from megapipe.testing.hosts import TestHosts, own_counters
from megapipe.training.trainer import Trainer

HOSTS, PER_HOST = 2, 2
WORLD = HOSTS * PER_HOST
GLOBAL_BATCH, MICRO_BATCH = 16, 2
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--max-position-embeddings", "128", "--mock-data", "--vocab-size", "2047",  # + end of document: V = 2048
         "--make-vocab-size-divisible-by",
         "128", "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(GLOBAL_BATCH),
         "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "1", "--fusion-backend", "eager",
         "--lr-decay-style", "constant"]
UNTIED = ["--untie-embeddings-and-output-weights"]
# (name, t, p, d, sharding, extra flags): every kind of traffic across the hosts at least once
LAYOUTS = [
    ("data parallel", 1, 1, 4, "no_shard", UNTIED),
    ("pipeline across", 1, 2, 2, "no_shard", UNTIED),
    ("tensor inside, pipeline across", 2, 2, 1, "no_shard", UNTIED),
    ("same, no scatter/gather", 2, 2, 1, "no_shard", UNTIED + ["--no-scatter-gather-tensors-in-pipeline"]),
    ("tensor inside, data across", 2, 1, 2, "no_shard", UNTIED),
    ("data parallel, ZeRO-1", 1, 1, 4, "optim", UNTIED),
    ("data parallel, ZeRO-3", 1, 1, 4, "optim_grads_params", UNTIED),
    ("pipeline of 4", 1, 4, 1, "no_shard", UNTIED),
    ("pipeline across, tied embedding", 1, 2, 2, "no_shard", []),
    ("tensor across hosts", 4, 1, 1, "no_shard", UNTIED),
]
QUICK = [0, 1, 2, 3]


def layout_argv(t: int, p: int, d: int, sharding: str, extra: list[str]) -> list[str]:
    return MODEL + extra + ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p),
                            "--data-parallel-sharding-strategy", sharding]


def measure(rank, world_size, runs):
    """Per run (argv), the counters this host's first rank saw change while the run trained (None elsewhere)."""
    first = rank % PER_HOST == 0
    changes = []
    for argv in runs:
        dist.barrier()
        before = own_counters() if first else None
        Trainer(parse_run("gpt", argv, world_size=world_size)).train()
        dist.barrier()
        changes.append(own_counters() - before if first else None)
    return changes


def predict(t: int, p: int, d: int, sharding: str, extra: list[str]):
    tied = "--untie-embeddings-and-output-weights" not in extra
    shape = ModelShape("gpt", 4, 256, 8, 128, 2048, 1024, tied)
    profile = analytic_gpt_profile(shape, 1e12, (MICRO_BATCH,), dtype="float32")
    cluster = Cluster(nodes=HOSTS, gpus_per_node=PER_HOST, memory_per_gpu=1e10, intra_node_bandwidth=1e9,
                      inter_node_bandwidth=1e8, backend="gloo")
    training = Training(GLOBAL_BATCH, scatter_gather="--no-scatter-gather-tensors-in-pipeline" not in extra)
    return PlanCostModel(profile, cluster, training).traffic(Candidate(t, p, d, MICRO_BATCH, "1f1b", sharding=sharding))


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="the first 4 layouts")
    parser.add_argument("--iterations", type=int, nargs=2, default=(1, 4), metavar=("K1", "K2"))
    args = parser.parse_args()
    chosen = [LAYOUTS[i] for i in QUICK] if args.quick else LAYOUTS
    k1, k2 = args.iterations
    runs = [layout_argv(*layout[1:]) + ["--train-iters", str(k)] for layout in chosen for k in (k1, k2)]
    start = time.perf_counter()
    with TestHosts(HOSTS) as hosts:
        per_rank = run_distributed(WORLD, measure, runs, hosts=hosts, timeout=3600, collective_timeout=300)
    print(f"GPT 4 layers, h=256, s=128, V=2048, fp32, global batch {GLOBAL_BATCH} of micro-batches of {MICRO_BATCH}; "
          f"{HOSTS} hosts x {PER_HOST} ranks (network namespaces); iterations {k2} - {k1}, "
          f"{time.perf_counter() - start:.0f} s")
    print(f"\n{'layout':<34} {'t p d':<6} {'sharding':<19} {'predicted payload':>17} {'measured':>10} "
          f"{'predicted wire':>14} {'measured':>10} {'/predicted':>10} {'KB/sample':>9}")
    sent = {}
    for index, (name, t, p, d, sharding, extra) in enumerate(chosen):
        runs_sent = []
        for k in (k1, k2):
            counted = [ranks[2 * index + (k == k2)] for ranks in per_rank if ranks[2 * index + (k == k2)] is not None]
            runs_sent.append((sum(c.sent_bytes for c in counted), sum(c.sent_packets for c in counted)))
        wire = (runs_sent[1][0] - runs_sent[0][0]) / (k2 - k1)
        payload = wire - FRAME_OVERHEAD * (runs_sent[1][1] - runs_sent[0][1]) / (k2 - k1)
        traffic = predict(t, p, d, sharding, extra)
        sent[name] = wire
        print(f"{name:<34} {t} {p} {d:<2} {sharding:<19} {traffic.total / 1e6:>14.3f} MB {payload / 1e6:>7.3f} MB "
              f"{wire_bytes(traffic.total) / 1e6:>11.3f} MB {wire / 1e6:>7.3f} MB {wire / wire_bytes(traffic.total):>10.3f} "
              f"{wire / GLOBAL_BATCH / 1e3:>9.1f}")
        print(f"{'':<34} predicted: pipeline {traffic.pipeline / 1e6:.3f}, tied embedding {traffic.embedding / 1e6:.3f}, "
              f"data {traffic.data / 1e6:.3f}, tensor {traffic.tensor / 1e6:.3f} MB")
    if "data parallel" in sent and "pipeline across" in sent:
        print(f"\npipeline across the hosts sends {1 - sent['pipeline across'] / sent['data parallel']:.1%} fewer bytes "
              "per sample than data parallelism across them")
    if "same, no scatter/gather" in sent:
        print(f"scatter/gather cuts the pipeline's bytes by "
              f"{sent['same, no scatter/gather'] / sent['tensor inside, pipeline across']:.2f}x (t = 2)")


if __name__ == "__main__":
    main()
