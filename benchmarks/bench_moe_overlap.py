"""Training steps of an MoE GPT at e = 2 with ``--overlap-moe-expert-parallel-comm`` off and on.

    python benchmarks/bench_moe_overlap.py             # 1F1B at p = 1 on 2 gloo processes, 8 rounds
    python benchmarks/bench_moe_overlap.py --quick     # 2 rounds, a smoke test
    python benchmarks/bench_moe_overlap.py --schedule dualpipev --processes 4
    python benchmarks/bench_moe_overlap.py --rate-mbit 200 --latency-ms 2   # each rank a host, shaped links (root)

Two engines start from the same weights, one with the overlap off and one with it on (the schedule's
forward/backward pairs run on two threads, one microbatch's expert all-to-all beside the other's
compute); their first step's losses must be equal bit for bit. Then they take turns, one training step
each per round in a rotated order, each step between two barriers. The table gives the median step
times and the median over rounds of off / on (> 1: the overlap is faster), and, from a timeline
recorded in one more step with the overlap on, the share of the all-to-alls' time during which the
other microbatch of the pair computed. The CPU seconds per step say whether the processes did the same
work (on a machine loaded by others a process with two runnable threads may also get a larger share
of the cores, which the wall-clock ratio then includes). On loopback an all-to-all is CPU work of both
ranks; with ``--rate-mbit`` / ``--latency-ms`` each rank is a network-namespace host
(``megapipe.testing.hosts``) behind a shaped link, so an all-to-all waits on a network as between nodes.
"""

from __future__ import annotations

import datetime
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from harness import cli, report
from harness.pairing import take_turns, timed
from harness.ratios import median_ratio
from megapipe.config import ModelConfig, OptimizerConfig
from megapipe.layout.placement import Placement
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.schedules.analysis.timeline import Timeline
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.hosts import TestHosts
from megapipe.testing.worlds import run_distributed

MODES = ("off", "on")


@dataclass(frozen=True)
class OverlapSettings:
    schedule: str = "1f1b"
    processes: int = 2  # e = 2; p = 2 as well for dualpipev
    num_layers: int = 2
    hidden_size: int = 256
    ffn_hidden_size: int = 512  # each expert's
    num_experts: int = 8
    topk: int = 2
    seq_length: int = 256
    micro_batch_size: int = 2
    microbatches: int = 4
    rounds: int = 8

    @property
    def pipeline(self) -> int:
        return 2 if self.schedule == "dualpipev" else 1

    def describe(self) -> str:
        return (f"GPT of {self.num_layers} MoE layers, hidden {self.hidden_size}, {self.num_experts} experts of ffn "
                f"{self.ffn_hidden_size}, top-{self.topk}, seq {self.seq_length} x batch {self.micro_batch_size}, "
                f"{self.microbatches} microbatches, fp32; {self.schedule} at p = {self.pipeline}, e = 2, "
                f"{self.processes} processes, {self.rounds} rounds")

    def config(self) -> ModelConfig:
        return ModelConfig(num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=4,
                           vocab_size=512, seq_length=self.seq_length, ffn_hidden_size=self.ffn_hidden_size,
                           swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                           add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                           num_experts=self.num_experts, moe_router_topk=self.topk)


def world(rank: int, world_size: int, settings: OverlapSettings) -> dict:
    torch.set_num_threads(1)
    v = 2 if settings.schedule == "dualpipev" else 1
    placement = Placement.V if v == 2 else Placement.LOOPED
    ps = ParallelState.initialize(pipeline=settings.pipeline, expert=2, virtual_pipeline=v, placement=placement)
    config = settings.config()
    g = torch.Generator().manual_seed(ps.dp_rank)
    shape = (settings.micro_batch_size, settings.seq_length)
    batch = [{"tokens": torch.randint(0, config.vocab_size, shape, generator=g),
              "labels": torch.randint(0, config.vocab_size, shape, generator=g),
              "loss_mask": torch.ones(shape)} for _ in range(settings.microbatches)]
    sgd = OptimizerConfig(optimizer="sgd", lr=1e-3, weight_decay=0.0, clip_grad=0.0)
    timeline = Timeline()
    engines = {mode: PipelineEngine(build_model_chunks("gpt", config, ps), ps, sgd, settings.schedule,
                                    settings.microbatches, (settings.seq_length, settings.micro_batch_size,
                                                            settings.hidden_size),
                                    timeout=datetime.timedelta(seconds=600), overlap_moe_comm=mode == "on",
                                    timeline=timeline if mode == "on" else None)
               for mode in MODES}
    first = {mode: timed(lambda: engines[mode].train_batch(batch).batch.loss_tensors)[2] for mode in MODES}
    equal = all(torch.equal(a, b) for a, b in zip(first["off"], first["on"]))
    hidden, phases = timeline.hidden_phases()
    engines["on"].executor.timeline = None  # the timed steps record nothing
    steps = take_turns(MODES, settings.rounds, lambda mode, r: timed(lambda: engines[mode].train_batch(batch))[:2])
    return {"wall": {mode: [w for w, _ in steps[mode]] for mode in MODES},
            "cpu": {mode: [c for _, c in steps[mode]] for mode in MODES}, "equal": equal, "hidden": hidden,
            "phases": phases}


def main(argv=None) -> int:
    parser = cli.parser(__doc__, quick="2 rounds: a smoke test", rounds_help="", json="")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "dualpipev"))
    parser.add_argument("--processes", type=int, default=None, help="ranks (default 2; 4 for dualpipev)")
    parser.add_argument("--seq-length", type=int, default=OverlapSettings.seq_length)
    parser.add_argument("--hidden-size", type=int, default=OverlapSettings.hidden_size)
    parser.add_argument("--num-layers", type=int, default=OverlapSettings.num_layers)
    parser.add_argument("--rate-mbit", type=float, help="each rank a host behind a link of this rate")
    parser.add_argument("--latency-ms", type=float, help="each rank a host behind a link of this one-way delay")
    args = parser.parse_args(argv)
    processes = args.processes or (4 if args.schedule == "dualpipev" else 2)
    settings = OverlapSettings(schedule=args.schedule, processes=processes, seq_length=args.seq_length,
                               hidden_size=args.hidden_size, num_layers=args.num_layers,
                               rounds=cli.rounds_of(args, OverlapSettings.rounds))
    print(f"model: {settings.describe()}")
    print(f"machine: {report.machine()}, torch {torch.__version__}, one thread per rank")
    if args.rate_mbit is None and args.latency_ms is None:
        per_rank = run_distributed(processes, world, settings, timeout=3600, collective_timeout=600)
    else:
        print(f"network: each rank a host, links of {args.rate_mbit or 'unlimited'} Mbit/s and "
              f"{args.latency_ms or 0} ms one-way delay")
        with TestHosts(processes, rate_mbit=args.rate_mbit, latency_ms=args.latency_ms) as hosts:
            per_rank = run_distributed(processes, world, settings, hosts=hosts, timeout=3600, collective_timeout=600)
    wall, cpu = per_rank[0]["wall"], per_rank[0]["cpu"]
    ratio = median_ratio(wall["off"], wall["on"])
    hidden = sum(r["hidden"] for r in per_rank) / max(sum(r["phases"] for r in per_rank), 1e-12)
    report.print_markdown(
        ["schedule", "step off (s, median)", "step on (s, median)", "off time / on time (median)",
         "CPU s per step off / on (rank 0)", "all-to-all time hidden"],
        [[settings.schedule, f"{statistics.median(wall['off']):.3f}", f"{statistics.median(wall['on']):.3f}",
          f"**{ratio:.2f}**", f"{statistics.median(cpu['off']):.3f} / {statistics.median(cpu['on']):.3f}",
          f"{100 * hidden:.0f}%"]])
    print(f"\nload average at the end: {report.load_average()}")
    report.write_json(args.json, {"settings": asdict(settings), "ratio": ratio, "hidden": hidden,
                                  "wall": wall})
    if not all(r["equal"] for r in per_rank):
        print("FAILED: the first step's losses differ between overlap off and on")
        return 1
    print("the first step's losses are equal bit for bit with the overlap off and on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
