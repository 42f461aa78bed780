"""Expert parallelism's token dispatch: in a world of 2 expert ranks (each holding 2 of 4 experts), both
dispatchers give each rank's tokens the one-rank layer's outputs and input gradients, the router its
gradient, and each expert the sum of the gradients the one-rank layer gives it over both ranks' tokens."""

import pytest
import torch
from test_moe_layer import moe_config

from megapipe.models.moe.layer import MoELayer
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(10 + rank))


def _run(layer: MoELayer, x: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in layer.named_parameters()}


def _check(rank: int, world: int) -> list[str]:
    ps = ParallelState.initialize(expert=2)
    reference = MoELayer(moe_config(), ParallelState.single(), "layers.0.mlp", 1, False, 0.01)
    ones = [_run(reference, _tokens(r)) for r in range(world)]
    checked = []
    for dispatcher in ("alltoall", "allgather"):
        config = moe_config(moe_token_dispatcher_type=dispatcher)
        layer = MoELayer(config, ps, "layers.0.mlp", 1, False, 0.01)
        out, x_grad, grads = _run(layer, _tokens(rank))
        mine = slice(2 * rank, 2 * rank + 2)
        torch.testing.assert_close(out, ones[rank][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x_grad, ones[rank][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grads["router.weight"], ones[rank][2]["router.weight"], rtol=1e-5, atol=1e-6)
        for name in ("experts.fc1.weight", "experts.fc2.weight"):
            summed = sum(one[2][name] for one in ones)[mine]
            torch.testing.assert_close(grads[name], summed, rtol=1e-5, atol=1e-6)
            assert grads[name].shape[0] == 2 and getattr(layer.get_parameter(name), "expert_parallel")
        checked.append(dispatcher)
    return checked


def test_both_dispatchers_match_the_one_rank_layer():
    assert run_distributed(2, _check, timeout=120) == [["alltoall", "allgather"]] * 2
