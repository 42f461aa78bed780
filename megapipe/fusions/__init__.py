"""Fused kernels for the transformer layer (seed 002 sections 4.4.2 and 4.5.8).

What the model calls; each ``fused`` argument is the matching ``ModelConfig`` boolean, and
``fused=False`` is the plain PyTorch composition the fused op must equal:

    bias_gelu(x, bias, approximate="none"|"tanh", fused=cfg.bias_gelu_fusion)
    bias_dropout_add(x, bias, residual, p, training, fused=cfg.bias_dropout_fusion)
    scale_mask_softmax(scores, scale, mask=None, causal=False, softmax_in_fp32=True,
                       fused=cfg.masked_softmax_fusion)
    attention(q, k, v, mask=None, causal=False, dropout_p=0.0, training=False, scale=None,
              softmax_in_fp32=True, fused=cfg.masked_softmax_fusion, sdpa=True)   # [b, heads, s, d]
    swiglu(x, bias=None, fused=cfg.bias_swiglu_fusion)   # x = [..., (gate, up) x f] -> [..., f]
    apply_rope(x, cos, sin, fused=cfg.apply_rope_fusion)   # x [b, heads, s, d]; rotary_tables(positions, ...)
    LayerNorm(hidden_size, eps), RMSNorm(hidden_size, eps)

Masks are boolean, True = masked out. The kernels come from one backend chosen at start-up,
``select_backend("auto"|"apex"|"triton"|"compile"|"eager", device)``, which logs its choice;
without a call, the first fused op chooses "auto" for the default device. Vocab-parallel
cross-entropy's elementwise parts live in ``megapipe.fusions.cross_entropy``, its fused one-read
passes (``cross_entropy_loss_fusion``) in ``megapipe.fusions.fused_cross_entropy``.
"""

from megapipe.fusions.attention import attention
from megapipe.fusions.backend import FusionBackend, active_backend, select_backend
from megapipe.fusions.bias_dropout_add import bias_dropout_add
from megapipe.fusions.bias_gelu import bias_gelu
from megapipe.fusions.norms import LayerNorm, RMSNorm, layer_norm, rms_norm
from megapipe.fusions.rope import apply_rope, rotary_tables
from megapipe.fusions.softmax import scale_mask_softmax
from megapipe.fusions.swiglu import swiglu

__all__ = [
    "FusionBackend", "LayerNorm", "RMSNorm", "active_backend", "apply_rope", "attention", "bias_dropout_add",
    "bias_gelu", "layer_norm", "rms_norm", "rotary_tables", "scale_mask_softmax", "select_backend", "swiglu",
]
