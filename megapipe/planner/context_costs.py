"""What context parallelism costs a rank: the key/value exchange of every block, and its activations.

A rank of c context ranks holds b s / c tokens of each sequence, so its activations, its share of
every GEMM and of attention's s x s scores (its queries against every key) are all 1/c of the whole
sequence's. What it adds is the exchange of keys and values inside its context group, per block
and microbatch, for the ``--cp-comm-type`` (``layout/context_comm.py``); with n = b s / c tokens,
w = h / t the attention width of a tensor rank (keys and values as wide as the queries) and e bytes
per element, ``kv = 2 n w e``:

* ``p2p`` (ring): c - 1 steps forward, each sending this rank's current key/value block to the
  next rank; backward c - 1 steps carrying the block and its gradient (2 kv);
* ``all_gather``: forward an all-gather of the c blocks; backward the all-gather again (the gathered
  keys are not kept) and a reduce-scatter of their gradients;
* ``a2a`` (Ulysses): forward one all-to-all of queries, keys and values and one of the output
  (4 n w e leaving each rank in all, (c-1)/c of it to other ranks), backward the same.

The planner does not model ``a2a+p2p``. Recomputation repeats the forward's exchanges in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.errors import ConfigError
from megapipe.planner.analytic import LOGITS_BYTES
from megapipe.planner.profile import ModelShape

PLANNED_COMM_TYPES = ("p2p", "all_gather", "a2a")


@dataclass(frozen=True)
class Exchange:
    """One kind of message a context rank takes part in, per block and microbatch."""

    backward: bool
    kind: str  # "send" (one ring step), "all_gather", "reduce_scatter" or "all_to_all"
    nbytes: float  # a ring step's message, the gathered tensor, a reduce-scatter's input, or all an all-to-all sends
    count: int = 1


def exchanges(comm_type: str, context: int, tokens: float, width: float, element_bytes: int) -> list[Exchange]:
    """The exchanges of one block for ``tokens`` (b s / c) per rank of attention width ``width`` (module docstring)."""
    if context == 1:
        return []
    kv = 2 * tokens * width * element_bytes
    if comm_type == "p2p":
        return [Exchange(False, "send", kv, context - 1), Exchange(True, "send", 2 * kv, context - 1)]
    if comm_type == "all_gather":
        return [Exchange(False, "all_gather", context * kv), Exchange(True, "all_gather", context * kv),
                Exchange(True, "reduce_scatter", context * kv)]
    if comm_type == "a2a":
        return [Exchange(False, "all_to_all", 2 * kv), Exchange(True, "all_to_all", 2 * kv)]
    raise ConfigError(f"the planner models --cp-comm-type {', '.join(PLANNED_COMM_TYPES)}, not {comm_type}; "
                      "plan with one of those.")


def activation_bytes_per_rank(shape: ModelShape, seq_length: int, context: int, micro_batch_size: int = 1,
                              element_bytes: int = 2, tensor: int = 1) -> float:
    """Peak bytes one rank keeps for backward in a forward of ``micro_batch_size`` sequences of ``seq_length``
    tokens split over ``context`` ranks (and ``tensor`` ranks), every block of ``shape`` at once (one stage,
    no recomputation), with fused attention (no s x s scores kept: its output and per-query log-sum-exp).

    Per block, for n = b s / c tokens: norm inputs, QKV and fc1 inputs (4 e n h) and two 1-byte dropout
    masks (2 n h) on every tensor rank; QKV output, attention output and log-sum-exp, GeLU input and
    output (4 e n h + 4 n a + 2 e n ffn) split by t. Then the embedding's output and mask, and the head's
    input and fp32 logits (split by t). Everything is linear in n: the model's prediction is 1/c.
    """
    if seq_length % (2 * context):
        raise ConfigError(f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size {context}.")
    n = micro_batch_size * seq_length / context
    h, heads, e = shape.hidden_size, shape.num_attention_heads, element_bytes
    blocks = sum(4 * e * n * h + 2 * n * h + (4 * e * n * h + LOGITS_BYTES * n * heads
                                              + 2 * e * n * shape.active_ffn_hidden_size(layer)) / tensor
                 for layer in range(shape.num_layers))
    ends = (e + 1) * n * h + e * n * h + LOGITS_BYTES * n * shape.vocab_size / tensor
    return blocks + ends
