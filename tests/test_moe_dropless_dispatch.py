"""``--moe-dropless-device-dispatch``: the all-to-all with fixed buffers and counts kept on the device gives
the host-split all-to-all's outputs and gradients bit for bit, reads nothing on the host, and refuses the
flags it cannot honour in one sentence each.

Both dispatches run the same grouped product over the same rows in the same (expert, source) order; the
fixed one only adds zero rows past the product's last offset, so the results are identical, not merely
close. The routings cover a balanced map, every token of both ranks sent to one rank's experts (the
buffer filled to its bound) and a rank that sends the other nothing.
"""

import pytest
import torch

from megapipe.config import ModelConfig
from megapipe.config.moe import validate_moe
from megapipe.errors import ConfigError
from megapipe.models.moe import dispatch
from megapipe.models.moe.experts import GroupedExperts
from megapipe.models.moe.router import Routing
from megapipe.parallel.launch import counting_synchronisations
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

TOKENS, HIDDEN, EXPERTS, TOPK = 6, 16, 4, 2


def _config(**fields) -> ModelConfig:
    base = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, vocab_size=32, seq_length=TOKENS,
                ffn_hidden_size=32, swiglu=True, add_bias_linear=False, num_experts=EXPERTS, moe_router_topk=TOPK,
                moe_grouped_gemm=True, moe_dropless_device_dispatch=True)
    return ModelConfig(**{**base, **fields})


def _routing(kind: str, rank: int) -> Routing:
    """A [TOKENS, EXPERTS] routing of TOPK experts per token; experts 0-1 live on rank 0, 2-3 on rank 1."""
    g = torch.Generator().manual_seed(rank)
    if kind == "balanced":
        chosen = torch.rand(TOKENS, EXPERTS, generator=g).topk(TOPK, dim=1).indices
    elif kind == "all to rank 0":
        chosen = torch.tensor([[0, 1]] * TOKENS)
    else:  # "kept at home": every rank's tokens go to its own experts only
        chosen = torch.tensor([[2 * rank, 2 * rank + 1]] * TOKENS)
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, chosen, True)
    probs = torch.rand(TOKENS, EXPERTS, generator=g) * routing_map
    return Routing(probs, routing_map)


def _run(rank: int, kind: str, bound: int | None):
    """Outputs, the tokens' gradient and the experts' weight gradients of one dispatch, and its host reads."""
    ps = ParallelState.initialize(expert=2)
    experts = GroupedExperts(_config(), ps, "experts", seed=3, output_std=0.02)
    tokens = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    routing = _routing(kind, rank)
    with counting_synchronisations(torch.device("cpu")) as reads:
        out = dispatch.alltoall(tokens, routing, TOKENS * TOPK, experts, ps, bound=bound)
        out.square().sum().backward()
    grads = [tokens.grad] + [p.grad for p in experts.parameters()]
    return out.detach(), grads, list(reads)


def _compare(rank, world_size):
    bound = TOKENS * min(TOPK, EXPERTS // 2)
    results = {}
    for kind in ("balanced", "all to rank 0", "kept at home"):
        split_out, split_grads, split_reads = _run(rank, kind, None)
        fixed_out, fixed_grads, fixed_reads = _run(rank, kind, bound)
        results[kind] = (torch.equal(split_out, fixed_out),
                         all(torch.equal(a, b) for a, b in zip(split_grads, fixed_grads)),
                         split_out.abs().sum().item() > 0, len(split_reads), fixed_reads)
    return results


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fixed_buffers_give_the_host_split_results_bit_for_bit_without_host_reads():
    for rank, results in enumerate(run_distributed(2, _compare, timeout=100)):
        for kind, (same_out, same_grads, nonzero, split_reads, fixed_reads) in results.items():
            assert same_out and same_grads and nonzero, (rank, kind)
            assert split_reads > 0, (rank, kind)  # the host-split dispatch reads its splits: the count sees it
            assert fixed_reads == [], (rank, kind, fixed_reads)


@pytest.mark.unit
@pytest.mark.parametrize("fields, message", [
    (dict(moe_expert_capacity_factor=1.5), "--moe-expert-capacity-factor 1.5 lets an expert keep only 0.75 of a "
                                           "micro-batch's tokens, so it drops tokens, but --moe-dropless-device-"
                                           "dispatch asks for none dropped; leave the factor out, or raise it to "
                                           "at least 2"),
    (dict(moe_expert_capacity_factor=2.0, moe_pad_expert_input_to_capacity=True), "keep one"),
    (dict(moe_token_dispatcher_type="allgather"), "drop --moe-token-dispatcher-type allgather or the flag"),
    (dict(moe_grouped_gemm=False), "needs --moe-grouped-gemm"),
])
def test_flags_it_cannot_honour_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("-", r"\-")):
        validate_moe(_config(**fields), tensor_parallel=1, expert_parallel=2)


@pytest.mark.unit
def test_a_capacity_factor_that_cannot_drop_is_accepted():
    validate_moe(_config(moe_expert_capacity_factor=2.0), tensor_parallel=1, expert_parallel=2)
