"""Checkpoint save and load bandwidth: megapipe's sharded checkpoints against one torch.save file per rank.

    python benchmarks/bench_checkpoint.py                  # GPT of 85 M parameters, worlds of 1 and 2
    python benchmarks/bench_checkpoint.py --layers 2       # a quick smoke run

Each world builds a real Trainer (GPT with GPT-2 small's body: 768 hidden, 12 heads, 12
layers; split t ways in a world of t), trains one step so the Adam moments exist, then times
on every rank, between barriers (the slowest rank counts):

* megapipe save: ``Checkpointer.save`` (DCP pieces of every rank, fsync, atomic publication);
* megapipe load: ``Checkpointer.load`` of that checkpoint (checks, reads, copies into the model);
* megapipe async save: how long training is blocked (copies to CPU) and until it is published;
* torch.save / torch.load: the same model and optimizer state dicts in one file per rank
  (fsync included, as megapipe's save syncs too), then ``load_state_dict``.

Bandwidth is checkpoint bytes over seconds. Loads read files just written, from the page
cache; nothing here can drop that cache on a shared machine, so loads measure CPU and
memory cost more than the disk.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from harness import cli
from harness.pairing import timed
from megapipe.testing.worlds import run_distributed


def _seconds(fn) -> float:
    """Seconds until the slowest rank is done with ``fn`` (all ranks start together)."""
    return timed(fn)[0]


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _plain_save(trainer, path: str) -> None:
    state = {"model": [chunk.state_dict() for chunk in trainer.chunks],
             "optimizer": trainer.engine.optimizer.state_dict()}
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _plain_load(trainer, path: str) -> None:
    state = torch.load(path, weights_only=True)
    for chunk, chunk_state in zip(trainer.chunks, state["model"]):
        chunk.load_state_dict(chunk_state)
    trainer.engine.optimizer.load_state_dict(state["optimizer"])


def _bench_world(rank, world_size, layers, root, repeats):
    os.environ["MEGAPIPE_CACHE"] = os.path.join(root, "cache")
    from megapipe.cli.parse import parse_run
    from megapipe.training.trainer import Trainer

    flags = ["--num-layers", str(layers), "--hidden-size", "768", "--num-attention-heads", "12",
             "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
             "--eval-iters", "1", "--log-interval", "1", "--fusion-backend", "eager",
             "--tensor-model-parallel-size", str(world_size)]
    trainer = Trainer(parse_run("gpt", flags, world_size=world_size))
    trainer.train()
    directory = os.path.join(root, f"world{world_size}")
    plain = os.path.join(directory, f"plain_rank{rank}.pt")
    rows = {"megapipe save": [], "megapipe load": [], "async save: training blocked": [],
            "async save: until published": [], "torch.save (file per rank)": [], "torch.load (file per rank)": []}
    for _ in range(repeats):
        trainer.config.training.async_save = False
        rows["megapipe save"].append(_seconds(lambda: trainer.checkpointer.save(directory)))
        rows["megapipe load"].append(_seconds(lambda: trainer.checkpointer.load(directory)))
        trainer.config.training.async_save = True
        started = time.perf_counter()
        rows["async save: training blocked"].append(_seconds(lambda: trainer.checkpointer.save(directory)))
        trainer.checkpointer.wait()
        done = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        rows["async save: until published"].append(done.item())
        rows["torch.save (file per rank)"].append(_seconds(lambda: _plain_save(trainer, plain)))
        rows["torch.load (file per rank)"].append(_seconds(lambda: _plain_load(trainer, plain)))
    sizes = torch.tensor([_directory_bytes(os.path.join(directory, "iter_0000001")),
                          os.path.getsize(plain)], dtype=torch.float64)
    dist.all_reduce(sizes[1:])  # every rank wrote its own plain file
    params = sum(p.numel() for chunk in trainer.chunks for p in chunk.parameters())
    total = torch.tensor([params], dtype=torch.float64)
    dist.all_reduce(total)
    return rows, sizes.tolist(), int(total.item())


def main(argv=None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        for world in args.world_sizes:
            rows, (megapipe_bytes, plain_bytes), params = run_distributed(
                world, _bench_world, args.layers, root, args.repeats, timeout=3600)[0]
            print(f"\nworld of {world} (t={world}), GPT with {params / 1e6:.1f} M parameters; checkpoint "
                  f"{megapipe_bytes / 2 ** 20:.0f} MiB (megapipe) / {plain_bytes / 2 ** 20:.0f} MiB (torch.save)")
            print(f"{'operation':<32}{'median s':>10}{'MiB/s':>10}")
            for name, times in rows.items():
                median = statistics.median(times)
                size = plain_bytes if name.startswith("torch") else megapipe_bytes
                print(f"{name:<32}{median:>10.2f}{size / 2 ** 20 / median:>10.0f}")


if __name__ == "__main__":
    main()
