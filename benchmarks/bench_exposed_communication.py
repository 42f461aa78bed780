"""Exposed communication per training step, by kind, with each overlap off and on, on two hosts.

    python benchmarks/bench_exposed_communication.py                  # links of 1000 Mbit/s (root)
    python benchmarks/bench_exposed_communication.py --quick          # 2 steps per case, a smoke test
    python benchmarks/bench_exposed_communication.py --rate-mbit 200  # a slower link
    python benchmarks/bench_exposed_communication.py --kinds tensor   # the tensor-parallel cases only

Each of the two ranks is a network-namespace host (``megapipe.testing.hosts``) behind a link shaped to
``--rate-mbit``, so every collective between them waits on a network as between nodes. For each case a
GPT trains with the overlap off and then on, from the same weights; ``Trainer.exposed_communication``
reports, after one warm-up step, the seconds per step in which the rank computed nothing while it waited
on communication (``parallel/exposure.py``), per kind. The table gives the case's own kind off and on
and their ratio (> 1: less exposed with the overlap) and the step's wall time off and on; the weights the
two runs end with must be equal bit for bit (every overlap here computes the same numbers):

* tensor, t = 2 without and with sequence parallelism: ``--no-async-tensor-model-parallel-allreduce``
  against the default, the column-parallel linears' input-gradient all-reduce (reduce-scatter) behind
  their weight-gradient products, with sequence parallelism also the input re-gathered behind the
  input-gradient product instead of kept (``tensor_parallel/column_input.py``);
* expert, e = 2: the expert all-to-alls, ``--overlap-moe-expert-parallel-comm`` off and on;
* data, ZeRO-1 at d = 2: ``--use-distributed-optimizer`` with and without ``--overlap-grad-reduce
  --overlap-param-gather``;
* data, ZeRO-3 at d = 2: ``--data-parallel-sharding-strategy optim_grads_params``, the same two flags.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from harness import cli, report
from megapipe.cli.parse import parse_run
from megapipe.testing.hosts import TestHosts
from megapipe.testing.worlds import run_distributed
from megapipe.training.trainer import Trainer

MODEL = ["--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "2", "--mock-data", "--vocab-size", "512", "--train-iters", "1000",
         "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
# (name, kind, flags of both runs, flags of the run with the overlap off, flags of the run with it on)
CASES = [
    ("t = 2", "tensor", ["--tensor-model-parallel-size", "2", "--global-batch-size", "4"],
     ["--no-async-tensor-model-parallel-allreduce"], []),
    ("t = 2, sequence parallel", "tensor", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                           "--global-batch-size", "4"],
     ["--no-async-tensor-model-parallel-allreduce"], []),
    ("e = 2, 8 experts top-2", "expert", ["--num-experts", "8", "--moe-router-topk", "2", "--disable-bias-linear",
                                          "--expert-model-parallel-size", "2", "--ffn-hidden-size", "512",
                                          "--global-batch-size", "16"],
     [], ["--overlap-moe-expert-parallel-comm"]),
    ("ZeRO-1, d = 2", "data", ["--use-distributed-optimizer", "--global-batch-size", "8"],
     [], ["--overlap-grad-reduce", "--overlap-param-gather"]),
    ("ZeRO-3, d = 2", "data", ["--data-parallel-sharding-strategy", "optim_grads_params", "--global-batch-size", "8"],
     [], ["--overlap-grad-reduce", "--overlap-param-gather"]),
]


def world(rank: int, world_size: int, steps: int, kinds: tuple, hidden: int) -> list:
    torch.set_num_threads(1)
    out = []
    for name, kind, common, off, on in _cases(kinds):
        row = {}
        for mode, extra in (("off", off), ("on", on)):
            flags = MODEL + ["--hidden-size", str(hidden)] + common + extra
            trainer = Trainer(parse_run("gpt", flags, world_size=world_size))
            start = time.perf_counter()
            exposed = trainer.exposed_communication(steps)
            wall = (time.perf_counter() - start) / (steps + 1)
            trainer.engine.drain()
            trainer.exit_conditions.close()
            with trainer.engine.whole_weights():  # ZeRO-3 keeps only its shard between passes
                weights = torch.cat([p.detach().reshape(-1) for chunk in trainer.chunks for p in chunk.parameters()])
            row[mode] = {"exposed": exposed, "wall": wall, "weights": weights}
        row["equal"] = torch.equal(row["off"].pop("weights"), row["on"].pop("weights"))
        out.append(row)
    return out


def _cases(kinds: tuple) -> list:
    return [case for case in CASES if not kinds or case[1] in kinds]


def main(argv=None) -> int:
    parser = cli.parser(__doc__, quick="2 steps per case: a smoke test", rounds_help="", json="")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="each rank a host behind a link of this rate")
    parser.add_argument("--hidden-size", type=int, default=256, help="the model's hidden size (ffn: 4x)")
    parser.add_argument("--kinds", default="", help="comma-separated kinds to run (default: all): tensor, expert, data")
    args = parser.parse_args(argv)
    steps = cli.rounds_of(args, 6)
    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    print(f"model: GPT of 2 layers, hidden {args.hidden_size}, seq 256 x micro-batch 2, fp32; {steps} steps per run "
          "after one warm-up")
    print(f"machine: {report.machine()}, torch {torch.__version__}, one thread per rank; each rank a host behind "
          f"a {args.rate_mbit:g} Mbit/s link")
    with TestHosts(2, rate_mbit=args.rate_mbit) as hosts:
        per_rank = run_distributed(2, world, steps, kinds, args.hidden_size, hosts=hosts, timeout=3600, collective_timeout=600)
    rows, results = [], []
    for (name, kind, *_), cases in zip(_cases(kinds), zip(*per_rank)):
        off = statistics.mean(case["off"]["exposed"].get(kind, 0.0) for case in cases)
        on = statistics.mean(case["on"]["exposed"].get(kind, 0.0) for case in cases)
        wall_off = statistics.mean(case["off"]["wall"] for case in cases)
        wall_on = statistics.mean(case["on"]["wall"] for case in cases)
        rows.append([name, kind, f"{1000 * off:.1f}", f"{1000 * on:.1f}", f"**{off / max(on, 1e-9):.2f}**",
                     f"{wall_off:.3f} / {wall_on:.3f}"])
        results.append({"case": name, "kind": kind, "off": off, "on": on, "wall": [wall_off, wall_on]})
    unequal = [name for (name, *_), cases in zip(_cases(kinds), zip(*per_rank)) if not all(case["equal"] for case in cases)]
    report.print_markdown(["case", "kind", "exposed off (ms/step)", "exposed on (ms/step)", "off / on",
                           "step s off / on"], rows)
    print(f"\nload average at the end: {report.load_average()}")
    report.write_json(args.json, {"rate_mbit": args.rate_mbit, "steps": steps, "results": results})
    if unequal:
        print(f"FAILED: the weights differ between the overlap off and on in: {', '.join(unequal)}")
        return 1
    print("the weights after the steps are equal bit for bit with each overlap off and on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
