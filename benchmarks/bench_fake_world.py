"""Every parallel dimension at real shapes in one process: rank 0 of a world of 8 on PyTorch's fake process group
and fake tensors, its device memory per training step next to the planner's model.

    python benchmarks/bench_fake_world.py                 # every case below
    python benchmarks/bench_fake_world.py --cases tp8     # some of them
    python benchmarks/bench_fake_world.py --quick         # two layers of each model: seconds (the suite's run)
    python benchmarks/bench_fake_world.py --world-size 6  # refused: the layouts need 8

``torch.distributed``'s ``fake`` backend (``torch.testing._internal.distributed.fake_pg``, made for this)
answers every collective at once without moving data, so one process builds rank 0's process groups of
a world of 8 and runs its part of a step: the model built by megapipe's builder for that rank, a forward
and a backward through the tensor-, sequence-, context- and expert-parallel layers with their
collectives, the gradient sync at its sharding level and AdamW (bf16 weights, fp32 main gradients and
masters). The tensors are fake and on the fake accelerator (``megapipe.testing.fake_device``): no kernel
runs, every storage is counted from its creation until its last user lets it go, so the peak is what a
GPU's allocator would hold before its rounding and fragmentation. Attention runs as a GPU's flash kernel.
The planner's MEMORY(.) for the same layout stands beside it. Cases:

* ``tp8``: GPT-1.3B (24 layers, hidden 2048, sequence 2048, micro-batch 1) at t = 8 with sequence parallelism;
* ``cp2``: GPT-1.3B at t = 4, c = 2 (the ring);
* ``zero1`` / ``zero3``: GPT-1.3B at d = 8, ``optim`` and ``optim_grads_params``;
* ``moe``: two Mixtral-shaped layers (hidden 4096, 8 experts of ffn 14336, top-2, 32 heads in 8 groups) at
  e = 8 with grouped experts, each padded to its capacity (the dispatch reads nothing on the host).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from harness import cli
from harness.report import print_markdown
from megapipe.config import ModelConfig, OptimizerConfig
from megapipe.errors import ConfigError
from megapipe.models import build_model_chunks
from megapipe.optim import build_optimizer
from megapipe.optim.finalize import finalize_model_grads
from megapipe.optim.grad_buffer import GradBuffers
from megapipe.optim.passes import SyncPasses
from megapipe.parallel.state import ParallelState
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cost_model import Candidate, PlanCostModel, Training
from megapipe.planner.presets import cluster_preset
from megapipe.planner.profile import ModelShape
from megapipe.planner.units import GIB
from megapipe.testing.fake_device import (FAKE_DEVICE, DeviceMemory, fake_accelerator, flash_attention,
                                          fused_optimizers)

GPT_1_3B = dict(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50257, seq_length=2048)
MIXTRAL_LAYERS = dict(num_layers=2, hidden_size=4096, num_attention_heads=32, num_query_groups=8, vocab_size=32000,
                      seq_length=4096, ffn_hidden_size=14336, swiglu=True, normalization="RMSNorm",
                      position_embedding_type="rope", add_bias_linear=False, untie_embeddings_and_output_weights=True,
                      num_experts=8, moe_router_topk=2, moe_grouped_gemm=True, moe_expert_capacity_factor=1.0,
                      moe_pad_expert_input_to_capacity=True)


@dataclass(frozen=True)
class Case:
    what: str
    model: dict
    tensor: int = 1
    context: int = 1
    expert: int = 1
    sharding: str = "no_shard"
    extra: dict = field(default_factory=dict)

    @property
    def sequence_parallel(self) -> bool:
        return self.tensor > 1


CASES = {
    "tp8": Case("GPT-1.3B, t = 8, sequence parallel", GPT_1_3B, tensor=8),
    "cp2": Case("GPT-1.3B, t = 4, c = 2 (ring)", GPT_1_3B, tensor=4, context=2),
    "zero1": Case("GPT-1.3B, d = 8, ZeRO-1", GPT_1_3B, sharding="optim"),
    "zero3": Case("GPT-1.3B, d = 8, ZeRO-3", GPT_1_3B, sharding="optim_grads_params"),
    "moe": Case("2 Mixtral layers, e = 8, grouped experts", MIXTRAL_LAYERS, expert=8),
}


def config_of(case: Case, layers: int | None = None) -> ModelConfig:
    """bf16, dropout off, selective recomputation; the attention runs as the flash kernel, which keeps no
    [s, s] scores: the planner's profile of such a block (``selective``, ``flash``)."""
    model = dict(case.model, num_layers=layers or case.model["num_layers"])
    return ModelConfig(**model, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16,
                       recompute_granularity="selective")


def measured_peak(case: Case, layers: int | None = None) -> float:
    """Rank 0's peak device bytes over two training steps of ``case`` (``layers`` of it) in the fake world."""
    ps = ParallelState.initialize(tensor=case.tensor, context=case.context, expert=case.expert)
    config = config_of(case, layers)
    sequence = config.seq_length // case.context
    optimizer_config = OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0, bf16=True,
                                       data_parallel_sharding_strategy=case.sharding)
    # AdamW fused, as a GPU runs it: the foreach kernels' parameter-sized temporaries would be the peak
    with fake_accelerator(), fused_optimizers(), DeviceMemory() as memory, flash_attention():
        model = build_model_chunks("gpt", config, ps, sequence_parallel=case.sequence_parallel,
                                   device=FAKE_DEVICE)[0].train()
        grads = GradBuffers([model], ps, level=optimizer_config.sharding)
        optimizer = build_optimizer([model], optimizer_config, ps, grads)
        # the executor's hooks around each pass: ZeRO-3 gathers and frees the weights a layer at a time
        passes = SyncPasses(grads.syncs, 1, [model])
        for _ in range(2):
            tokens = torch.zeros(1, sequence, dtype=torch.long, device=FAKE_DEVICE)
            batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(1, sequence, device=FAKE_DEVICE)}
            passes.before_pass(False, 0)
            loss = model(None, batch)
            passes.after_pass(False, 0)
            passes.before_pass(True, 0)
            optimizer.scale_loss(loss).backward()
            passes.after_pass(True, 0)
            finalize_model_grads([model], ps, grads)
            optimizer.step()
            optimizer.zero_grad()
            passes.updated([0])
    return memory.peak


def planned_peak(case: Case, world: int, layers: int | None = None) -> float:
    """The planner's MEMORY(.) of the same layout and micro-batch."""
    config = config_of(case, layers)
    shape = ModelShape.from_config("gpt", replace(config, vocab_size=config.padded_vocab_size(case.tensor)))
    profile = analytic_gpt_profile(shape, achieved_flops=1e14, micro_batch_sizes=(1,), dtype="bfloat16",
                                   selective=True, flash=True)
    data = world // (case.tensor * case.context)
    costs = PlanCostModel(profile, cluster_preset("a100-80gb-1x8"), Training(global_batch_size=data))
    return costs.estimate(Candidate(case.tensor, 1, data, 1, "1f1b", sharding=case.sharding, expert=case.expert,
                                    context=case.context, sequence_parallel=case.sequence_parallel)).memory


def main(argv=None) -> int:
    parser = cli.parser(__doc__, quick="two layers of each model")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--world-size", type=int, default=8, help="the fake world's ranks (the cases need 8)")
    args = parser.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # the fake accelerator is the meta device: the fake backend serves it too
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=0, world_size=args.world_size)
    print(f"torch {torch.__version__}; rank 0 of a fake world of {args.world_size}, bf16 weights, fp32 main "
          "gradients and AdamW masters, micro-batch 1, two steps")
    rows = []
    for name in args.cases.split(","):
        case = CASES[name]
        started = time.perf_counter()
        try:
            fake = measured_peak(case, 2 if args.quick else None)
        except ConfigError as error:
            print(f"error: {case.what} cannot run in a fake world of {args.world_size}: {error}")
            return 2
        planned = planned_peak(case, args.world_size, 2 if args.quick else None)
        rows.append([case.what, f"{fake / GIB:.2f}", f"{planned / GIB:.2f}", f"**{planned / fake:.2f}**",
                     f"{time.perf_counter() - started:.0f}"])
        print(rows[-1], flush=True)
    print_markdown(["case", "rank 0 peak, fake device (GiB)", "planner (GiB)", "planner / fake", "seconds"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
