"""The optimizer step's passes over the gradients: the norm in one multi-tensor read, clipping folded into
torch's fused update, the bf16 copy in one multi-tensor copy, zeroing in one fill per chunk.

References: the grouped norm as it was computed before (one ``_foreach_norm`` per group of the norm's
rule, summed in the same order), bit for bit; clipping first by ``_foreach_mul_`` and then the same fused
torch optimizer: bit for bit when nothing is clipped (the divisor is exactly 1), else within the rounding
of a multiply against that of a divide (each one rounding of the clipped gradient, so at most 2^-23
relative apart, and the update is as close); the counts of passes from the operations dispatched.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe.optim import GradBuffers, OptimizerConfig, build_optimizer
from megapipe.optim.clip import CLIP_EPSILON, local_squared_norm
from megapipe.parallel.state import ParallelState

pytestmark = pytest.mark.unit

PS = ParallelState.single()


class Dispatched(TorchDispatchMode):
    """Counts the operations dispatched, by name (``aten._foreach_norm`` ...)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def params_with_grads(seed: int = 0) -> list[torch.nn.Parameter]:
    """Parameters of every kind the norm tells apart: counted, the last stage's embedding copy (not
    counted), experts (counted, summed over the expert group)."""
    generator = torch.Generator().manual_seed(seed)
    params = []
    for index, shape in enumerate([(7, 5), (5,), (11, 3), (4, 4, 2), (9,), (6, 6)]):
        param = torch.nn.Parameter(torch.zeros(shape))
        param.grad = torch.randn(shape, generator=generator)
        if index == 2:
            param.shared_embedding = True
        if index in (3, 4):
            param.expert_parallel = True
        params.append(param)
    return params


def grouped_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The squared norm as computed before: one ``_foreach_norm`` per group, in the same order."""
    def part(group, counted):
        grads = [p.grad for p in group if (not getattr(p, "shared_embedding", False)) == counted]
        return torch.stack(torch._foreach_norm(grads)).square().sum() if grads else torch.zeros(())

    def squares(group):
        return torch.zeros(()) + part(group, True) + 0.0 * part(group, False)

    dense = [p for p in params if not getattr(p, "expert_parallel", False)]
    experts = [p for p in params if getattr(p, "expert_parallel", False)]
    return squares(dense) + squares(experts) * 1.0


def test_the_norm_reads_every_gradient_in_one_pass_bit_for_bit():
    params = params_with_grads()
    with Dispatched() as dispatched:
        squared = local_squared_norm(params, PS)
    assert dispatched.ops["_foreach_norm"] == 1
    assert torch.equal(squared, grouped_norm(params))
    params[2].grad[0, 0] = float("inf")  # an uncounted copy that went bad still poisons the norm
    assert local_squared_norm(params, PS).isnan()


def mlp(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3)).to(dtype)


def stepped(optimizer: str, clip_grad: float, fold: bool):
    """An fp32 model's parameters after two steps on fixed main gradients of norm about 20: through the
    optimizer wrapper (``fold``), or clipped by ``_foreach_mul_`` and then stepped by the same fused torch
    optimizer, as before (``fold`` False)."""
    model = mlp(torch.float32)
    grads = GradBuffers([model], PS)
    config = OptimizerConfig(optimizer=optimizer, lr=0.1, sgd_momentum=0.9, weight_decay=0.1, clip_grad=clip_grad)
    opt = build_optimizer([model], config, PS, grads)
    assert opt.inner.defaults["fused"]
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        with torch.no_grad():
            grads.buffer.copy_(torch.randn(grads.buffer.shape, generator=generator) * 2)
        if fold:
            with Dispatched() as dispatched:
                opt.step()
            assert dispatched.ops["_foreach_mul_"] == 0  # the fused kernel divides as it reads
        else:
            norm = torch.linalg.vector_norm(grads.buffer)
            opt._attach_main_grads()
            torch._foreach_mul_(opt.main_grads, (clip_grad / (norm + CLIP_EPSILON)).clamp(max=1.0))
            opt.inner.found_inf, opt.inner.grad_scale = torch.zeros(()), None
            opt.inner.step()
        clipped = grads.buffer.clone()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], clipped


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_clipping_folded_into_the_fused_update_matches_clipping_first(optimizer):
    for clip_grad, clips in ((1.0, True), (100.0, False)):
        (ours, our_grads), (theirs, their_grads) = stepped(optimizer, clip_grad, True), stepped(optimizer, clip_grad,
                                                                                                False)
        if not clips:  # divided by exactly 1: the same update bit for bit
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)) and torch.equal(our_grads, their_grads)
            continue
        # g / ((n + eps) / c) and g * (c / (n + eps)): two roundings each, 2^-23 relative apart at most
        torch.testing.assert_close(our_grads, their_grads, rtol=2.0 ** -22, atol=0.0)
        for a, b in zip(ours, theirs):  # parameters of size ~1: their updates agree to the last bit or two
            torch.testing.assert_close(a, b, rtol=0.0, atol=4 * 2.0 ** -24)


def test_a_bf16_step_makes_one_pass_of_each_kind():
    """One norm read, no clipping pass, one fused update per parameter group (with and without weight
    decay), one bf16 copy, one fill of the buffer."""
    model = mlp(torch.bfloat16)
    grads = GradBuffers([model], PS)
    opt = build_optimizer([model], OptimizerConfig(lr=0.1, bf16=True, clip_grad=0.01), PS, grads)
    with torch.no_grad():
        grads.buffer.normal_()
    with Dispatched() as dispatched:
        result = opt.step()
        opt.zero_grad()
    assert result.grad_norm > 0.01  # clipped
    ops = dispatched.ops
    assert len(opt.param_groups) == 2
    assert (ops["_foreach_norm"], ops["_fused_adamw_"], ops["_foreach_copy_"], ops["zero_"]) == (1, 2, 1, 1), ops
    assert ops["_foreach_mul_"] == ops["mul_"] == 0, ops
    assert all(torch.equal(p, main.to(torch.bfloat16)) for p, main in zip(model.parameters(), opt.main_params))
    assert not grads.buffer.any()
