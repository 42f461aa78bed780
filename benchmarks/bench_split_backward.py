"""A zero-bubble schedule's split backward (BI then BW) against one whole backward (B), on one stage.

    python benchmarks/bench_split_backward.py              # 30 rounds
    python benchmarks/bench_split_backward.py --rounds 60 -- --num-layers 8

One process builds ``pretrain_gpt.py``'s ``Trainer`` for half of ``bench_trainer_overhead.py``'s model
(4 layers, hidden 256, 4 heads, sequence 128, microbatches of 2, the byte-level vocabulary and head,
fp32; flags after ``--`` change it) with a zero-bubble schedule, so its weights have main-gradient
targets as in training. Each round runs one forward and then B, and one forward and then BI + BW
(``tensor_parallel/split_backward.py``: BI inside ``deferring_weight_gradients``, BW
``apply_weight_gradients``), in an order that alternates by round, on the same microbatch; the
gradients are cleared in between. Reported: the median milliseconds of B, BI, BW and BI + BW, and
the median of the per-round ratios (BI + BW) / B. Alone on one core the pair does the work of one
backward; inside a pipeline both ranks' passes also contend for the shared caches and memory.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from harness import cli, report
from megapipe.cli.parse import parse_run
from megapipe.pipeline.executor import _backward_from
from megapipe.tensor_parallel.split_backward import apply_weight_gradients, deferring_weight_gradients
from megapipe.testing.worlds import run_distributed
from megapipe.training.trainer import Trainer

FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "1", "--eval-iters", "0",
         "--pipeline-schedule", "zb-h1"]
WARMUP = 3


def world(rank: int, world_size: int, rounds: int, extra: list[str]) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    trainer = Trainer(parse_run("gpt", FLAGS + extra, world_size=world_size))
    chunk, microbatch = trainer.chunks[0], next(trainer.train_batches())[0]

    def whole() -> dict[str, float]:
        loss = chunk(None, microbatch)
        begin = time.perf_counter()
        _backward_from(loss, torch.ones_like(loss))
        return {"B": time.perf_counter() - begin}

    def split() -> dict[str, float]:
        loss, deferred = chunk(None, microbatch), []
        begin = time.perf_counter()
        with deferring_weight_gradients(deferred):
            _backward_from(loss, torch.ones_like(loss))
        middle = time.perf_counter()
        apply_weight_gradients(deferred)
        return {"BI": middle - begin, "BW": time.perf_counter() - middle}

    times: dict[str, list[float]] = {"B": [], "BI": [], "BW": []}
    for round_ in range(WARMUP + rounds):
        for run in ((whole, split) if round_ % 2 == 0 else (split, whole)):
            measured = run()
            for sync in trainer.engine.syncs:  # a new backward, as after an optimizer step
                sync.finish_grad_sync()
                sync.zero()
            if round_ >= WARMUP:
                for name, seconds in measured.items():
                    times[name].append(seconds)
    return times


def main(argv=None) -> int:
    parser = cli.parser(__doc__, rounds=30, rounds_help="rounds of B and of BI + BW (default 30)")
    parser.add_argument("extra", nargs="*", help="after --: more pretrain_gpt.py flags")
    args = parser.parse_args(argv)
    print(f"pretrain_gpt.py {' '.join(FLAGS + args.extra)}; one process, one thread")
    print(f"machine: {report.machine()}")
    times = run_distributed(1, world, args.rounds, args.extra, timeout=1800)[0]
    pair = [bi + bw for bi, bw in zip(times["BI"], times["BW"])]
    report.print_markdown(["pass", "median ms"], ([name, f"{1e3 * statistics.median(values):.2f}"]
                                                  for name, values in [*times.items(), ("BI + BW", pair)]))
    ratios = sorted(a / b for a, b in zip(pair, times["B"]))
    print(f"\n(BI + BW) / B, median of {len(ratios)} rounds: **{statistics.median(ratios):.3f}** "
          f"(lowest {ratios[0]:.3f}, highest {ratios[-1]:.3f})")
    print(f"load average at the end: {report.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
