"""A closed-form profile of a GPT shape, for models too big to profile here (e.g. 1.3B-3.8B on 64 GPUs).

Times come from FLOP counts (seed 002 section 4.5.1, the terms of eq. 4.2): a block's forward
is ``24 b s h^2 + 4 b s^2 h`` for ffn = 4h (in general ``8 b s h^2 + 4 b s h ffn + 4 b s^2 h``),
backward twice that, recomputation one forward more; the head's logits cost ``2 b s h V``
forward (V padded as the model pads it) and twice that backward. SwiGLU's three MLP matrices and
grouped-query attention's narrower keys and values (``megapipe.models.flops.block_forward_flops``)
are counted as the model family counts them. A device runs them at ``achieved_flops * e(n)``, where the
efficiency ``e(n) = n / (n + half_tokens)`` of a GEMM over n tokens models that small
micro-batches do not fill the device; the default half point of 0.3 x 2048 tokens makes
throughput rise 1.3x from b = 1 to large b at s = 2048, as the seed reports for its 1B model
(Fig. 4.7). Bytes come from the shape: the tensors one block keeps for backward, counted for
this codebase's layer with e-byte activations and 1-byte dropout masks, are
  replicated across tensor ranks: 2 norm inputs, QKV and fc1 inputs (4e sbh), 2 dropout masks (2 sbh);
  split by tensor parallelism: QKV output e sb (h + 2 h_kv) with h_kv = query groups x head size
  (3e sbh under multi-head attention), attention context e sbh, the activation's input and output
  2e s b ffn (3e s b ffn for SwiGLU, whose input is gate and up), and per head the softmax output, its
  dropout mask and the dropped probabilities ((2e + 1) a b s^2),
which for e = 2 and ffn = 4h is the familiar ``sbh (34 + 5 a s / h)``. Selective recomputation
(``models/selective.py``) recomputes the norms' outputs (the QKV and fc1 inputs), the activation's output and
the dropout masks in the backward pass, so a block keeps the 2 norm inputs (2e sbh) replicated and QKV
output, context and GeLU input split: ``sbh (20 + 5 a s / h)`` for e = 2, ffn = 4h. The attention core's
``(2e + 1) a b s^2`` (``attention_core_bytes``) is what explicit attention keeps (the paper's count); with
``flash`` a fused kernel (SDPA's flash or memory-efficient attention, the default on a GPU) keeps its fp32
log-sum-exp of 4 a s b bytes instead. The norms' statistics, 4 or 8 bytes a token each, are left out. An MoE block (``--moe-layer-freq``
says which) costs its experts, router and shared expert instead of the dense MLP, with ffn the k experts'
width, keeps each token's k rows twice more (2k e sbh: the experts' input, sorted by expert, and their
outputs, which the routing weights multiply), and holds every expert's parameters: FLOPs and parameters are the model family's own counts
(``megapipe.models.flops``).
"""

from __future__ import annotations

from typing import Sequence

from megapipe.models import flops
from megapipe.planner.profile import ELEMENT_BYTES, LayerProfile, ModelProfile, ModelShape

DEFAULT_HALF_TOKENS = 0.3 * 2048
LOGITS_BYTES = 4  # the cross entropy keeps fp32 logits (softmax) per vocabulary entry


def block_forward_flops(shape: ModelShape, b: float, layer: int) -> float:
    """Block ``layer``'s forward FLOPs at micro-batch b (``megapipe.models.flops``: a dense MLP, or its
    experts, router and shared expert where ``--moe-layer-freq`` puts them)."""
    return flops.layer_forward_flops(b * shape.seq_length, shape.to_config(), layer)


def head_forward_flops(shape: ModelShape, b: float) -> float:
    """The logit layer's forward FLOPs at micro-batch b, over the padded vocabulary as the family counts them."""
    return flops.head_forward_flops(b * shape.seq_length, shape.hidden_size, shape.padded_vocab_size)


def block_params(shape: ModelShape, layer: int) -> tuple[int, int]:
    """(all, split) parameters of block ``layer`` (``megapipe.models.flops.layer_parameters``): tensor
    parallelism splits all but the norms, the row-parallel biases and an MoE block's router."""
    total, replicated = flops.layer_parameters(shape.to_config(), layer)
    return total, total - replicated


def attention_core_bytes(shape: ModelShape, b: float, element_bytes: int) -> float:
    """The softmax output, its dropout mask and the dropped probabilities of explicit attention: (2e + 1) a b s^2."""
    return (2 * element_bytes + 1) * shape.num_attention_heads * b * shape.seq_length ** 2


def flash_attention_bytes(shape: ModelShape, b: float) -> float:
    """What a fused attention kernel keeps besides its inputs and output: the fp32 log-sum-exp, 4 a b s."""
    return 4 * shape.num_attention_heads * b * shape.seq_length


def block_stash_bytes(shape: ModelShape, b: float, element_bytes: int, layer: int,
                      selective: bool = False, flash: bool = False) -> tuple[float, float]:
    """(all, split) bytes block ``layer`` keeps for backward at micro-batch b, without recomputation or with
    ``selective`` recomputation, its attention explicit or, with ``flash``, a fused kernel (module docstring)."""
    s, h, f, e = shape.seq_length, shape.hidden_size, shape.active_ffn_hidden_size(layer), element_bytes
    qkv_context = h + 2 * shape.kv_hidden_size + h  # QKV output (keys and values per query group) and context
    activation_input = 2 * f if shape.swiglu else f  # SwiGLU's gate and up halves
    if selective:  # norm inputs; QKV output, context, activation input
        replicated, split = 2 * e * s * b * h, e * s * b * qkv_context + e * s * b * activation_input
    else:  # also the norm outputs, the activation output and the two dropout masks
        replicated = 4 * e * s * b * h + 2 * s * b * h
        split = e * s * b * qkv_context + e * s * b * (activation_input + f)
    split += flash_attention_bytes(shape, b) if flash else attention_core_bytes(shape, b, e)
    if shape.is_moe_layer(layer):  # each token's k rows at the experts' input, and the k outputs the routing weighs
        replicated += 2 * shape.moe_router_topk * e * s * b * h
    return replicated + split, split


def _seconds(flops: float, tokens: float, achieved_flops: float, half_tokens: float) -> float:
    return flops / (achieved_flops * tokens / (tokens + half_tokens))


def analytic_gpt_profile(shape: ModelShape, achieved_flops: float, micro_batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
                         dtype: str = "float16", half_tokens: float = DEFAULT_HALF_TOKENS,
                         selective: bool = False, flash: bool = False) -> ModelProfile:
    """The profile a device reaching ``achieved_flops`` on large GEMMs would measure for ``shape`` (its blocks'
    stashes under ``--recompute-granularity selective`` when ``selective``, with a fused attention kernel's
    when ``flash``)."""
    e = ELEMENT_BYTES[dtype]
    s, h, v = shape.seq_length, shape.hidden_size, shape.vocab_size
    sizes = tuple(micro_batch_sizes)

    def seconds(flops_of) -> tuple[float, ...]:
        return tuple(_seconds(flops_of(b), b * s, achieved_flops, half_tokens) for b in sizes)

    def per_size(value_of) -> tuple[float, ...]:
        return tuple(float(value_of(b)) for b in sizes)

    zero = per_size(lambda b: 0.0)
    activation = per_size(lambda b: e * s * b * h)
    positions = s * h if shape.position_embedding_type == "learned_absolute" else 0
    embedding = LayerProfile("embedding", "embedding", params=v * h + positions, split_params=v * h, forward_s=zero,
                             backward_s=zero, recompute_backward_s=zero, output_bytes=activation,
                             stash_bytes=per_size(lambda b: s * b * h + 8 * s * b), split_stash_bytes=zero)

    def block(layer: int) -> LayerProfile:
        params, split_params = block_params(shape, layer)
        forward = seconds(lambda b: block_forward_flops(shape, b, layer))

        def stash(b):
            return block_stash_bytes(shape, b, e, layer, selective, flash)
        return LayerProfile(f"block.{layer}", "block", params=params, split_params=split_params, forward_s=forward,
                            backward_s=tuple(2 * t for t in forward), recompute_backward_s=tuple(3 * t for t in forward),
                            output_bytes=activation,
                            stash_bytes=per_size(lambda b: stash(b)[0]), split_stash_bytes=per_size(lambda b: stash(b)[1]))

    head_forward = seconds(lambda b: head_forward_flops(shape, b))
    logits = per_size(lambda b: LOGITS_BYTES * s * b * v)
    output_weight = 0 if shape.tied_embeddings else v * h  # an untied head owns its output weight
    final_norm = 2 * h if shape.normalization == "LayerNorm" else h  # RMSNorm has no bias
    head = LayerProfile("head", "head", params=final_norm + output_weight, split_params=output_weight,
                        forward_s=head_forward,
                        backward_s=tuple(2 * t for t in head_forward), recompute_backward_s=tuple(2 * t for t in head_forward),
                        output_bytes=per_size(lambda b: 4.0),
                        stash_bytes=tuple(2 * a + l for a, l in zip(activation, logits)), split_stash_bytes=logits)
    blocks = tuple(block(layer) for layer in range(shape.num_layers))
    return ModelProfile(shape, sizes, (embedding, *blocks, head), dtype, "analytic", "analytic")
