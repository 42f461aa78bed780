"""Scaled-dot-product attention on megapipe's own q, k and v: the views a layer really makes of its
[s, b, 3h] projection (multi-head and grouped-query), forced to the flash and cuDNN kernels one at
a time, causal, with and without dropout, forward and backward. A kernel that cannot take these
strided views raises instead of falling back to the math kernel silently; the kernel a layer takes
by default is read from the profiler and must not be the math one.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from megapipe import fusions
from megapipe.acceptance.record import Context, Record, assert_close
from megapipe.config import ModelConfig
from megapipe.models.transformer import SelfAttention
from megapipe.parallel.state import ParallelState

FORCED = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)
FAST_OPS = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention",
            "aten::_scaled_dot_product_efficient_attention")
# bf16 kernels against fp32 maths: inputs of unit size, softmax weights summing to 1, so every output
# is an average of bf16 values, off by a few bf16 roundings (2^-8 relative each) of the largest.
BF16 = dict(rtol=2 ** -6, scale=2 ** -6)


def layer_qkv(device: torch.device, groups: int, small: bool) -> tuple[torch.Tensor, ...]:
    """q, k, v exactly as megapipe's SelfAttention hands them to the attention core (bf16)."""
    heads, seq, batch, hidden = (4, 64, 2, 128) if small else (16, 2048, 2, 2048)
    config = ModelConfig(num_layers=1, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                         vocab_size=128, num_query_groups=groups, params_dtype=torch.bfloat16)
    layer = SelfAttention(config, ParallelState.single(), "probe", seed=1, sequence_parallel=False, device=device)
    captured = {}

    def capture(q, k, v, mask, causal):
        captured.update(q=q.detach(), k=k.detach(), v=v.detach())
        return q

    layer.core_attention = capture
    x = torch.randn(seq, batch, hidden, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x, None, causal=True)
    return captured["q"], captured["k"], captured["v"]


def _run(q, k, v, dropout: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # fresh leaves, the same strided views
    out = fusions.attention(q, k, v, None, causal=True, dropout_p=dropout, training=dropout > 0)
    out.float().sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad]


def check_forced(backend: SDPBackend, q, k, v, dropout: float) -> str:
    with sdpa_kernel([backend]):
        out, grads = _run(q, k, v, dropout)
    if dropout == 0.0:
        with sdpa_kernel([SDPBackend.MATH]):
            want, want_grads = _run(q.float(), k.float(), v.float(), 0.0)
        for name, a, b in zip(("output", "dq", "dk", "dv"), [out] + grads, [want] + want_grads):
            assert_close(a, b, **BF16, what=name)
        return "equal to fp32 maths within bf16 rounding"
    assert all(torch.isfinite(t).all() for t in [out] + grads), "non-finite values"
    return "ran, finite"


def default_kernel(q, k, v) -> str:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(q, k, v, 0.1)
    names = {event.key for event in prof.key_averages()}
    fast = [name for name in FAST_OPS if name in names]
    ops = sorted(name for name in names if "dot_product" in name)
    assert fast, f"scaled-dot-product attention fell back to the math kernel (ops: {ops})"
    return fast[0].removeprefix("aten::_scaled_dot_product_")


def run(record: Record, context: Context) -> None:
    if context.device.type != "cuda":
        record.skip("flash and cuDNN attention", "CUDA kernels: nothing to force on the CPU")
        return
    for name, groups in (("MHA", 16), ("GQA", 4)):
        q, k, v = layer_qkv(context.device, groups, small=False)
        for backend in FORCED:
            for dropout in (0.0, 0.1):
                record.check(f"{name} {backend.name.lower()} causal dropout {dropout}",
                             lambda: check_forced(backend, q, k, v, dropout))
        record.check(f"{name} default kernel", lambda: default_kernel(q, k, v))
