"""megapipe's data-parallel sharding levels and overlap against DDP + ZeroRedundancyOptimizer and FSDP2.

    python benchmarks/bench_data_parallel.py                 # p = 1 and 2, d = 2, 6 timed steps per system
    python benchmarks/bench_data_parallel.py --quick         # 2 timed steps per system, a smoke test
    python benchmarks/bench_data_parallel.py --rounds 12 --json out.json

For p in {1, 2} one world of p x 2 processes (gloo, one thread each) builds the same GPT from
the same megapipe stage modules and weights once per system and trains it on the same data
(each data-parallel rank its own half of every batch) with the same AdamW kernel:

* megapipe: ``PipelineEngine`` (1F1B) at each ``--data-parallel-sharding-strategy``, without
  and with ``--overlap-grad-reduce`` (and ``--overlap-param-gather`` where sharded);
* ``DDP + ZeRO``: ``torch.nn.parallel.DistributedDataParallel`` with
  ``ZeroRedundancyOptimizer`` (optimizer state sharded, as megapipe's ``optim``);
* ``FSDP2``: ``torch.distributed.fsdp.fully_shard`` per stage module (parameters, gradients
  and optimizer state sharded, as ``optim_grads_params``); gradients are reduced once per
  step (``set_requires_gradient_sync`` on the last microbatch), like every megapipe level.

At p = 2 the torch systems run ``torch.distributed.pipelining``'s ``Schedule1F1B`` over
``PipelineStage``\\ s of the DDP- or FSDP2-wrapped stage modules (the composition PyTorch
documents). The mean losses of the first steps must agree across all systems. Then the
systems take turns, one step each per round, in an order rotated every round, every step
between two barriers; the table gives the median step time and the median over rounds of
each system's ratio to the faster torch system of the same round.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch

from harness import cli, report
from harness.models import (MegapipeRunner, TensorStage, adamw, batch, make_loss_fn, megapipe_adamw_for,
                            same_weights)
from harness.pairing import take_turns, timed
from harness.ratios import max_relative_diff, median_ratio
from harness.settings import Settings
from megapipe.models import build_model_chunks
from megapipe.optim import OptimizerConfig, trainable_params, weight_decay_groups
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

D = 2
LEVELS = ("no_shard", "optim", "optim_grads", "optim_grads_params")
MEGAPIPE = [(level, overlap) for level in LEVELS for overlap in (False, True)]
TORCH = ("DDP + ZeRO", "FSDP2")
LOSS_TOLERANCE = 1e-5


@dataclass(frozen=True)
class ShardingSettings(Settings):
    num_microbatches: int = 4
    bucket_size: int = 1_000_000  # elements: a few buckets per chunk, so that overlap has something to split

    def describe(self) -> str:
        return (f"{self.describe_model()}; d = {D}, {self.num_microbatches} microbatches of {self.micro_batch_size} "
                f"per replica; AdamW; gloo; megapipe buckets of {self.bucket_size:,} elements; {self.rounds} timed "
                f"steps per system after {self.warmup_steps} warm-up steps")


def optimizer_config(strategy: str = "no_shard", overlap: bool = False, bucket_size: int = 0) -> OptimizerConfig:
    return adamw(data_parallel_sharding_strategy=strategy, ddp_bucket_size=bucket_size or None,
                 overlap_grad_reduce=overlap, overlap_param_gather=overlap and strategy != "no_shard")


class TorchRunner:
    """DDP + ZeroRedundancyOptimizer or FSDP2 over the stage module; torch's pipelining when p > 1."""

    def __init__(self, chunks, ps: ParallelState, settings: ShardingSettings, system: str):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel
        (chunk,) = chunks
        self.settings, self.ps, self.system = settings, ps, system
        self.loss_fn = make_loss_fn(ps)
        config = optimizer_config()
        if system == "FSDP2":
            mesh = init_device_mesh("cpu", (ps.pp_size, D), mesh_dim_names=("pp", "dp"))["dp"]
            for layer in chunk.layers.values():  # one FSDP unit per transformer layer, as FSDP2 recommends
                fully_shard(layer, mesh=mesh)
            self.module = fully_shard(TensorStage(chunk), mesh=mesh)
            params = list(self.module.parameters())
            groups = weight_decay_groups(params, params, config.weight_decay)
            self.optimizer = torch.optim.AdamW(groups, lr=config.lr, foreach=True)
        else:
            self.module = DistributedDataParallel(TensorStage(chunk), process_group=ps.dp_group)
            params = trainable_params([chunk])
            groups = weight_decay_groups(params, params, config.weight_decay)
            inner = megapipe_adamw_for([chunk], config)
            self.optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=type(inner), process_group=ps.dp_group,
                                                     lr=config.lr, **{k: v for k, v in inner.defaults.items()
                                                                      if k in ("fused", "foreach")})
        self.schedule = None
        if ps.pp_size > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B
            stage = PipelineStage(self.module, ps.pp_rank, ps.pp_size, torch.device("cpu"), group=ps.pp_group)
            self.schedule = Schedule1F1B(stage, settings.num_microbatches, loss_fn=self.loss_fn)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[float]:
        losses: list = []
        if self.schedule is not None:
            first, last = self.ps.is_first_stage, self.ps.is_last_stage
            self.schedule.step(*((tokens,) if first else ()), target=labels if last else None,
                               losses=losses if last else None, return_outputs=False)
        else:
            b, m = self.settings.micro_batch_size, self.settings.num_microbatches
            for i, (t, y) in enumerate(zip(tokens.split(b), labels.split(b))):
                final = i == m - 1
                if self.system == "FSDP2":
                    self.module.set_requires_gradient_sync(final)
                    context = contextlib.nullcontext()
                else:
                    context = contextlib.nullcontext() if final else self.module.no_sync()
                with context:
                    loss = self.loss_fn(self.module(t), y)
                    (loss / m).backward()
                losses.append(loss.detach())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return [loss.item() for loss in losses]


def name_of(strategy: str, overlap: bool) -> str:
    return f"megapipe {strategy}" + (" + overlap" if overlap else "")


def world(rank: int, world_size: int, settings: ShardingSettings) -> dict:
    p = world_size // D
    ps = ParallelState.initialize(pipeline=p)
    config = settings.model_config()
    reference = build_model_chunks("gpt", config, ps)
    runners = {}
    for strategy, overlap in MEGAPIPE:
        runners[name_of(strategy, overlap)] = MegapipeRunner(
            same_weights(config, ps, reference), ps, settings, "1f1b",
            optimizer_config(strategy, overlap, settings.bucket_size))
    for system in TORCH:
        runners[system] = TorchRunner(same_weights(config, ps, reference), ps, settings, system)
    names = list(runners)
    losses = {name: [] for name in names}
    for step in range(settings.warmup_steps):
        tokens, labels = batch(settings, step, D, ps.dp_rank)
        for name in names:
            losses[name].append(timed(partial(runners[name].step, tokens, labels))[2])
    wall = take_turns(names, settings.rounds, lambda name, r: timed(partial(
        runners[name].step, *batch(settings, settings.warmup_steps + r, D, ps.dp_rank)))[0])
    return {"wall": wall, "losses": losses if ps.is_last_stage else None}


def rows_of(p: int, per_rank: list[dict]) -> list[dict]:
    wall = per_rank[0]["wall"]
    best_torch = [min(wall[system][i] for system in TORCH) for i in range(len(wall[TORCH[0]]))]
    last = [r["losses"] for r in per_rank if r["losses"] is not None]
    means = {name: [statistics.mean(x for rank in last for x in rank[name][step]) for step in range(len(last[0][name]))]
             for name in wall}
    reference = means["megapipe no_shard"]
    rows = []
    for name, times in wall.items():
        rows.append({"p": p, "system": name, "step_s": statistics.median(times),
                     "ratio_to_best_torch": median_ratio(times, best_torch), "losses": means[name],
                     "loss_diff": max_relative_diff(means[name], reference)})
    return rows


def print_rows(rows: list[dict]) -> None:
    report.print_markdown(
        ["p", "system", "s/step (median)", "/ best torch system of the round (median)", "mean loss, steps 1-2",
         "max rel. loss diff to megapipe no_shard"],
        ([r["p"], r["system"], f"{r['step_s']:.3f}", f"**{r['ratio_to_best_torch']:.2f}**",
          " / ".join(f"{x:.5f}" for x in r["losses"]), f"{r['loss_diff']:.1e}"] for r in rows))


def main(argv=None) -> int:
    parser = cli.parser(__doc__, quick="2 timed steps per system: a smoke test", rounds_help="", json="")
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    settings = ShardingSettings(rounds=cli.rounds_of(args, ShardingSettings.rounds))
    print(f"model: {settings.describe()}")
    print(f"machine: {report.machine()}, torch "
          f"{torch.__version__}, one thread per rank")
    rows = []
    for p in args.pipeline_sizes:
        start = time.perf_counter()
        rows += rows_of(p, run_distributed(p * D, world, settings, timeout=3600, collective_timeout=600))
        print(f"p={p}: {time.perf_counter() - start:.0f} s", flush=True)
    print_rows(rows)
    print(f"\nload average at the end: {report.load_average()}")
    report.write_json(args.json, {"settings": asdict(settings), "rows": rows})
    bad = [r for r in rows if r["loss_diff"] > LOSS_TOLERANCE]
    if bad:
        print("FAILED: losses differ from megapipe no_shard by more than "
              f"{LOSS_TOLERANCE} for " + ", ".join(f"p={r['p']} {r['system']}" for r in bad))
        return 1
    print(f"every system's mean losses of the first {settings.warmup_steps} steps agree within {LOSS_TOLERANCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
