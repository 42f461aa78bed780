"""Model FLOPs of a GPT/BERT iteration, seed 002 equations 4.2-4.3.

Per transformer layer and sequence, a forward pass costs 24 s h^2 + 4 s^2 h multiply-adds x 2
(QKV, scores, attention over values, output projection, the h -> 4h -> h MLP); a backward
pass costs twice a forward, and full recomputation adds one more forward. The logit layer
costs 2 s h V forward and 4 s h V backward and is never recomputed. With recomputation this
is exactly eq. 4.2: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
"""

from __future__ import annotations

from megapipe.config import ModelConfig

# Dense bf16/fp16 tensor-core peaks, TFLOP/s, for model FLOPs utilisation when not given.
KNOWN_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "V100": 125.0, "A10": 125.0, "L4": 121.0}


def flops_per_iteration(config: ModelConfig, global_batch_size: int, recompute: bool) -> float:
    """Model FLOPs of one training iteration over ``global_batch_size`` sequences."""
    b, s, l, h = global_batch_size, config.seq_length, config.num_layers, config.hidden_size
    v = config.padded_vocab_size(1)  # the logit matmul runs over the padded vocabulary
    passes = 4 if recompute else 3
    per_layer_forward = 24 * b * s * h * h + 4 * b * s * s * h
    return passes * l * per_layer_forward + 6 * b * s * h * v


def parameter_count(config: ModelConfig) -> float:
    """Eq. 4.3: 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))."""
    l, h, v, s = config.num_layers, config.hidden_size, config.vocab_size, config.seq_length
    return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


def device_peak_tflops(device_name: str) -> float | None:
    for key, value in KNOWN_PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None
