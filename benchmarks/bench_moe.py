"""megapipe's MoE layer against transformers' Mixtral sparse block, forward + backward, at e = 1 and e = 2.

    python benchmarks/bench_moe.py                   # e = 1 and 2, 8 timed steps per system
    python benchmarks/bench_moe.py --quick           # 2 timed steps per system, a smoke test
    python benchmarks/bench_moe.py --experts 16 --tokens 2048 --json out.json
    python benchmarks/bench_moe.py --moe-grouped-gemm  # megapipe's experts as one torch._grouped_mm
    python benchmarks/bench_moe.py --moe-grouped-gemm --moe-dropless-device-dispatch --expert-sizes 2

Both sides hold the same weights (transformers' stacked ``gate_up_proj`` and ``down_proj`` mapped to
megapipe's layout as ``megapipe.models.hf_moe`` does) and see the same tokens. At e = 1 one process
runs both; at e = 2 two gloo processes (one thread each) run megapipe's ``MoELayer`` with the
all-to-all dispatcher, each holding half of the experts, while each runs transformers'
``MixtralSparseMoeBlock`` over all experts on its own tokens, as a user without expert parallelism
would. Every rank's outputs and input gradients must agree within 1e-5 before timing; then the
systems take turns, one step each per round, in an order rotated every round. The table gives
tokens/s over all ranks (median step) and the median over rounds of transformers' step time over
megapipe's (> 1: megapipe is faster).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass

import torch

from harness import cli, report
from harness.pairing import take_turns, timed
from harness.ratios import median_ratio
from megapipe.config import ModelConfig
from megapipe.models.hf_moe import stacked_gate_up
from megapipe.models.moe.layer import MoELayer
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

TOLERANCE = 1e-5
SYSTEMS = ("megapipe", "transformers")


@dataclass(frozen=True)
class MoESettings:
    hidden_size: int = 256
    ffn_hidden_size: int = 512  # each expert's
    num_experts: int = 8
    topk: int = 2
    tokens: int = 1024  # per rank: seq_length x micro_batch_size
    micro_batch_size: int = 2
    warmup_steps: int = 2
    rounds: int = 8
    hf_experts: str = "eager"  # transformers' experts implementation
    grouped_gemm: bool = False  # megapipe's --moe-grouped-gemm (torch._grouped_mm where it runs)
    dropless: bool = False  # megapipe's --moe-dropless-device-dispatch (fixed buffers, counts on the device)

    @property
    def seq_length(self) -> int:
        return self.tokens // self.micro_batch_size

    def describe(self) -> str:
        return (f"hidden {self.hidden_size}, {self.num_experts} experts of ffn {self.ffn_hidden_size}, top-{self.topk}, "
                f"{self.tokens} tokens per rank (seq {self.seq_length} x batch {self.micro_batch_size}), fp32, "
                f"SwiGLU, no capacity; megapipe's {'grouped product' if self.grouped_gemm else 'loop over experts'}"
                f"{', counts on the device' if self.dropless else ''}, "
                f"transformers' {self.hf_experts} experts; {self.rounds} timed steps per system after "
                f"{self.warmup_steps} warm-up steps")

    def megapipe_config(self) -> ModelConfig:
        return ModelConfig(num_layers=1, hidden_size=self.hidden_size, num_attention_heads=4, vocab_size=64,
                           seq_length=self.seq_length, ffn_hidden_size=self.ffn_hidden_size, swiglu=True,
                           normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                           hidden_dropout=0.0, attention_dropout=0.0, num_experts=self.num_experts,
                           moe_router_topk=self.topk, moe_token_dispatcher_type="alltoall",
                           moe_grouped_gemm=self.grouped_gemm, moe_dropless_device_dispatch=self.dropless)

    def transformers_block(self):
        """transformers' Mixtral sparse block at these sizes, initialised from a fixed seed."""
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        config = MixtralConfig(hidden_size=self.hidden_size, intermediate_size=self.ffn_hidden_size,
                               num_local_experts=self.num_experts, num_experts_per_tok=self.topk,
                               router_jitter_noise=0.0)
        config._experts_implementation = self.hf_experts
        block = MixtralSparseMoeBlock(config)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
        return block


def megapipe_layer(settings: MoESettings, ps: ParallelState, block) -> MoELayer:
    """megapipe's layer holding ``block``'s router and this expert rank's experts."""
    layer = MoELayer(settings.megapipe_config(), ps, "layers.0.mlp", 1, False, 0.01)
    local = settings.num_experts // ps.ep_size
    mine = slice(ps.ep_rank * local, (ps.ep_rank + 1) * local)
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.fc1.weight.copy_(stacked_gate_up(block.experts.gate_up_proj.detach())[mine])
        layer.experts.fc2.weight.copy_(block.experts.down_proj[mine])
    return layer


def step_of(module, x: torch.Tensor, grad: torch.Tensor, megapipe: bool):
    """One forward + backward of ``module`` on ``x`` in its own layout (megapipe [s, b, h], transformers
    [b, s, h]): (output, input gradient), both [s, b, h]."""
    def step():
        module.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_(True)
        out = module(inputs)[0] if megapipe else module(inputs)
        out.backward(grad)
        return (out.detach(), inputs.grad) if megapipe else (out.detach().transpose(0, 1), inputs.grad.transpose(0, 1))
    return step


def world(rank: int, world_size: int, settings: MoESettings) -> dict:
    torch.set_num_threads(1)
    ps = ParallelState.initialize(expert=world_size) if world_size > 1 else ParallelState.single()
    block = settings.transformers_block().train()
    layer = megapipe_layer(settings, ps, block).train()
    generator = torch.Generator().manual_seed(100 + rank)
    shape = (settings.seq_length, settings.micro_batch_size, settings.hidden_size)
    x, grad = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    steps = {"megapipe": step_of(layer, x, grad, True),
             "transformers": step_of(block, x.transpose(0, 1).contiguous(), grad.transpose(0, 1).contiguous(), False)}
    barriers = world_size > 1
    results = {name: timed(steps[name], barriers)[2] for name in SYSTEMS}
    diff = max(float((a - b).abs().max() / b.abs().max())
               for a, b in zip(results["megapipe"], results["transformers"]))
    for _ in range(settings.warmup_steps - 1):
        for name in SYSTEMS:
            timed(steps[name], barriers)
    wall = take_turns(SYSTEMS, settings.rounds, lambda name, r: timed(steps[name], barriers)[0])
    return {"wall": wall, "diff": diff}


def row_of(e: int, per_rank: list[dict], settings: MoESettings) -> dict:
    wall = per_rank[0]["wall"]
    tokens = settings.tokens * e
    return {"e": e, "diff": max(r["diff"] for r in per_rank),
            **{f"{name}_tokens_per_s": tokens / statistics.median(wall[name]) for name in SYSTEMS},
            "ratio": median_ratio(wall["transformers"], wall["megapipe"])}


def main(argv=None) -> int:
    parser = cli.parser(__doc__, quick="2 timed steps per system: a smoke test", rounds_help="", json="")
    parser.add_argument("--expert-sizes", type=int, nargs="+", default=[1, 2], help="values of e (processes)")
    parser.add_argument("--experts", type=int, default=MoESettings.num_experts)
    parser.add_argument("--tokens", type=int, default=MoESettings.tokens, help="tokens per rank")
    parser.add_argument("--hidden-size", type=int, default=MoESettings.hidden_size)
    parser.add_argument("--ffn-hidden-size", type=int, default=MoESettings.ffn_hidden_size, help="each expert's")
    parser.add_argument("--hf-experts", default=MoESettings.hf_experts, choices=("eager", "batched_mm", "grouped_mm"),
                        help="transformers' experts implementation")
    parser.add_argument("--moe-grouped-gemm", action="store_true",
                        help="megapipe's experts as torch._grouped_mm where this build runs it (else its loop)")
    parser.add_argument("--moe-dropless-device-dispatch", action="store_true",
                        help="megapipe's all-to-all with fixed buffers and the counts on the device (needs the above)")
    args = parser.parse_args(argv)
    settings = MoESettings(hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
                           num_experts=args.experts, tokens=args.tokens, hf_experts=args.hf_experts,
                           grouped_gemm=args.moe_grouped_gemm, dropless=args.moe_dropless_device_dispatch,
                           rounds=cli.rounds_of(args, MoESettings.rounds))
    bad_e = [e for e in args.expert_sizes if settings.num_experts % e]
    if bad_e or settings.tokens % settings.micro_batch_size:
        print(f"error: e must divide --experts ({settings.num_experts}) and --tokens must be even; "
              f"got e = {bad_e or args.expert_sizes}, --tokens {settings.tokens}", file=sys.stderr)
        return 2
    import transformers
    print(f"layer: {settings.describe()}")
    print(f"machine: {report.machine()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          "one thread per rank")
    rows = []
    for e in args.expert_sizes:
        if e == 1:
            per_rank = [world(0, 1, settings)]
        else:
            per_rank = run_distributed(e, world, settings, timeout=3600, collective_timeout=600)
        rows.append(row_of(e, per_rank, settings))
    report.print_markdown(
        ["e", "megapipe tokens/s", "transformers tokens/s", "transformers time / megapipe time (median)",
         "max rel. diff (outputs, input grads)"],
        ([r["e"], f"{r['megapipe_tokens_per_s']:,.0f}", f"{r['transformers_tokens_per_s']:,.0f}",
          f"**{r['ratio']:.2f}**", f"{r['diff']:.1e}"] for r in rows))
    print(f"\nload average at the end: {report.load_average()}")
    report.write_json(args.json, {"settings": asdict(settings), "rows": rows})
    bad = [r["e"] for r in rows if r["diff"] > TOLERANCE]
    if bad:
        print(f"FAILED: outputs or input gradients differ by more than {TOLERANCE} at e = {bad}")
        return 1
    print(f"outputs and input gradients agree within {TOLERANCE} on every rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
