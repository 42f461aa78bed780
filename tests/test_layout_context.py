"""The context-parallel chunk assignment: every token held once, equal causal work per rank, and
one-sentence errors for a sequence that does not split into 2c chunks."""

import pytest

from megapipe.errors import ConfigError
from megapipe.layout.context import check_sequence_split, chunk_ranges, local_positions

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("context", [1, 2, 3, 4, 8])
def test_every_token_is_held_by_exactly_one_rank(context):
    seq = 2 * context * 5
    held = sorted(j for rank in range(context) for j in local_positions(seq, context, rank))
    assert held == list(range(seq))


@pytest.mark.parametrize("context", [2, 4, 8])
def test_causal_work_is_equal_on_every_rank(context):
    """Brute force: a query at position j attends to j + 1 keys; sum that over each rank's tokens."""
    seq = 2 * context * 3
    work = {sum(j + 1 for j in local_positions(seq, context, rank)) for rank in range(context)}
    assert len(work) == 1


def test_rank_holds_chunk_i_then_its_mirror():
    assert chunk_ranges(16, 2, 0) == ((0, 4), (12, 16))
    assert chunk_ranges(16, 2, 1) == ((4, 8), (8, 12))
    assert chunk_ranges(16, 1, 0) == ((0, 16),)


def test_sequence_not_divisible_by_2c_names_both_flags():
    with pytest.raises(ConfigError, match=r"--seq-length 30 is not divisible by 2 x --context-parallel-size 4"):
        check_sequence_split(30, 4)
    with pytest.raises(ConfigError, match="--context-parallel-size 0"):
        check_sequence_split(16, 0)
