"""The user's mistakes about context parallelism, each one sentence naming the flags and the fix."""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.errors import ConfigError
from megapipe.layout.context import check_sequence_split
from megapipe.layout.context_comm import check_comm_type


def check_head_split(heads: int, query_groups: int, size: int, comm_type: str) -> None:
    """All-to-all over ``size`` ranks splits the (per tensor-parallel rank) heads and query groups."""
    for count, flag in ((heads, "--num-attention-heads"), (query_groups, "--num-query-groups")):
        if count % size:
            over = ("--context-parallel-size" if comm_type == "a2a"
                    else "the first of --hierarchical-context-parallel-sizes")
            raise ConfigError(
                f"--cp-comm-type {comm_type} splits the attention heads over {over} ({size}) ranks, but "
                f"{flag} gives {count} per tensor-parallel rank, not divisible by {size}; choose {flag} "
                f"divisible by {size} x --tensor-model-parallel-size, or --cp-comm-type p2p.")


def check_context_parallel(*, context: int, comm_type: str, seq_length: int, heads: int, query_groups: int,
                           tensor_parallel: int = 1, hierarchical_sizes: Sequence[int] | None = None,
                           attention_dropout: float = 0.0) -> None:
    """Every check of a context-parallel attention's settings, before any process group exists."""
    check_sequence_split(seq_length, context)
    if context == 1:
        return
    check_comm_type(context, comm_type, hierarchical_sizes)
    if attention_dropout > 0:
        raise ConfigError(
            f"--attention-dropout {attention_dropout} is not supported with --context-parallel-size {context} "
            "(each rank would draw its own dropout mask for its blocks of scores, so the model would depend on "
            "c); add --attention-dropout 0, as the documentation's context-parallel commands do.")
    if comm_type in ("a2a", "a2a+p2p"):
        size = context if comm_type == "a2a" else hierarchical_sizes[0]
        check_head_split(heads // tensor_parallel, query_groups // tensor_parallel, size, comm_type)
