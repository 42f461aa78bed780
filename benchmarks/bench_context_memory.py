"""Activation bytes of one context-parallel rank at a long sequence, on the fake device, next to the memory model.

A GPT with the 1.3B model's layer shape (hidden 2048, 16 heads, ffn 8192, GPT-2's vocabulary) and a
few layers, bf16, one sequence of 16K tokens, hidden dropout on (attention dropout is off: context
parallelism refuses it). For c = 1, 2, 4, 8, context rank 0 runs its forward and backward on fake
accelerator tensors (``megapipe.testing.fake_device``): no kernel runs, but every storage the device
would hold is counted from its creation to its release. Context rank 0 stands for every rank (each
holds s/c tokens and the same model). Its exchanges go nowhere: a key/value block "received" from
the previous rank is a fresh tensor of the block's shape, exactly what the ring allocates, so the
count is the real rank's; the loss's all-reduce of two numbers is skipped. At c = 1 attention is the
flash kernel a GPU runs (the fake device's ``scaled_dot_product_attention`` would otherwise pick the
math kernel and hold the s x s scores), as in ``bench_fake_memory.py``.

Columns: the bytes the forward keeps for the backward (live at the end of the forward, less the
weights), the peak over the forward and backward above the weights (gradients included), and the
memory model's ``activation_bytes_per_rank`` (``megapipe.planner.context_costs``), which counts the
first of these.

The ring (``--cp-comm-type p2p``, the default) is measured: its sends and receives are the exchanges
stubbed here; the other comm types' collectives are not.

    python benchmarks/bench_context_memory.py                         # 2 layers, 16K, c = 1, 2, 4, 8
    python benchmarks/bench_context_memory.py --num-layers 4 --context 1,16
"""

from __future__ import annotations

from dataclasses import replace
from unittest import mock

import torch
import torch.distributed as dist

from harness import cli
from harness.report import print_ruled
from bench_fake_memory import flash_attention
from megapipe.config import ModelConfig
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.planner.context_costs import activation_bytes_per_rank
from megapipe.planner.profile import ModelShape
from megapipe.planner.units import GIB
from megapipe.testing.fake_device import FAKE_DEVICE, DeviceMemory, fake_accelerator


def model_config(layers: int, seq_length: int) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                       vocab_size=50257, seq_length=seq_length, hidden_dropout=0.1, attention_dropout=0.0,
                       params_dtype=torch.bfloat16)


def context_rank(context: int) -> ParallelState:
    """Context rank 0 of ``context`` ranks on a ring, without process groups (its exchanges are sent nowhere)."""
    ps = ParallelState.single()
    ps.members["context"] = list(range(context))
    return ps


def exchanges_nowhere():
    """Point-to-point sends and receives and the loss's all-reduce do nothing; a received block is the
    fresh tensor the receiver allocated for it."""
    return [mock.patch.object(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0: tensor),
            mock.patch.object(dist, "batch_isend_irecv", lambda ops: []),
            mock.patch.object(dist, "all_reduce", lambda tensor, *args, **kwargs: None),
            mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", flash_attention)]


def measure(config: ModelConfig, context: int) -> tuple[int, int]:
    """(bytes kept for backward at the end of the forward, peak bytes over forward and backward), above the weights."""
    ps = context_rank(context)
    local = config.seq_length // context
    patches = exchanges_nowhere()
    with fake_accelerator(), DeviceMemory() as memory, patches[0], patches[1], patches[2], patches[3]:
        model = build_model_chunks("gpt", config, ps, device=FAKE_DEVICE)[0]
        batch = {"tokens": torch.zeros(1, local, dtype=torch.long, device=FAKE_DEVICE),
                 "labels": torch.zeros(1, local, dtype=torch.long, device=FAKE_DEVICE),
                 "loss_mask": torch.ones(1, local, device=FAKE_DEVICE)}
        weights = memory.current
        memory.reset_peak()
        loss = model(None, batch)
        kept = memory.current - weights
        loss.backward()
        return kept, memory.peak - weights


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=16384)
    parser.add_argument("--context", default="1,2,4,8", help="comma-separated context-parallel sizes")
    args = parser.parse_args()
    config = model_config(args.num_layers, args.seq_length)
    shape = ModelShape.from_config("gpt", replace(config, vocab_size=config.padded_vocab_size(1)))
    print(f"torch {torch.__version__}; GPT {args.num_layers} layers of the 1.3B shape, bf16, sequence "
          f"{args.seq_length}, micro-batch 1, --cp-comm-type p2p; bytes of context rank 0")
    print_ruled(f"{'c':>2s} {'tokens/rank':>11s} {'kept GiB':>9s} {'x c=1':>6s} {'peak GiB':>9s} {'x c=1':>6s} "
                f"{'model GiB':>9s} {'model/kept':>10s}")
    first = None
    for context in (int(c) for c in args.context.split(",")):
        kept, peak = measure(config, context)
        first = first or (kept, peak)
        model = activation_bytes_per_rank(shape, args.seq_length, context)
        print(f"{context:2d} {args.seq_length // context:11d} {kept / GIB:9.3f} {kept / first[0]:6.3f} "
              f"{peak / GIB:9.3f} {peak / first[1]:6.3f} {model / GIB:9.3f} {model / kept:10.3f}")


if __name__ == "__main__":
    main()
