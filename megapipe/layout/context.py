"""Which tokens of a sequence each context-parallel rank holds: pure arithmetic, no processes.

Context parallelism (c ranks) splits every sequence of s tokens into 2c equal chunks; rank i holds
chunks i and 2c-1-i, in that order. Under causal attention a query at position j attends to j+1
keys, so chunk k costs work growing with k; pairing the k-th chunk from the front with the k-th from
the back gives every rank the same work (Megatron-core's and Transformer Engine's load balancing).
A rank's local sequence is its two chunks concatenated; every formula over that order is here.
"""

from __future__ import annotations

from megapipe.errors import ConfigError


def check_sequence_split(seq_length: int, context: int) -> None:
    """One sentence naming the flags when ``seq_length`` does not split into 2c equal chunks."""
    if context < 1:
        raise ConfigError(f"--context-parallel-size {context} must be at least 1.")
    if context > 1 and seq_length % (2 * context):
        raise ConfigError(
            f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size {context} "
            f"(= {2 * context}): context parallelism splits each sequence into 2c equal chunks; "
            f"choose a sequence length that is a multiple of {2 * context}.")


def chunks_of_rank(context: int, rank: int) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in its local order: (i, 2c-1-i); (0,) when c = 1."""
    if context == 1:
        return (0,)
    return (rank, 2 * context - 1 - rank)


def chunk_ranges(seq_length: int, context: int, rank: int) -> tuple[tuple[int, int], ...]:
    """[start, end) token ranges of the sequence that rank ``rank`` holds, in its local order."""
    check_sequence_split(seq_length, context)
    if context == 1:
        return ((0, seq_length),)
    size = seq_length // (2 * context)
    return tuple((k * size, (k + 1) * size) for k in chunks_of_rank(context, rank))


def local_positions(seq_length: int, context: int, rank: int) -> list[int]:
    """The global positions of the rank's local tokens, in its local order."""
    return [j for start, end in chunk_ranges(seq_length, context, rank) for j in range(start, end)]
