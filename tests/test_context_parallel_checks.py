"""Bad context-parallel settings are refused in one sentence naming the flags (``ConfigError``)."""

import pytest
import torch

from megapipe.context_parallel import check_context_parallel, context_attention
from megapipe.errors import ConfigError
from megapipe.parallel.context import ContextGroups

pytestmark = pytest.mark.unit

GOOD = dict(context=4, comm_type="p2p", seq_length=64, heads=8, query_groups=4)


@pytest.mark.parametrize("change, words", [
    (dict(seq_length=60), ["--seq-length 60", "2 x --context-parallel-size 4"]),
    (dict(comm_type="a2a", heads=6, query_groups=6), ["--cp-comm-type a2a", "--num-attention-heads",
                                                       "--context-parallel-size"]),
    (dict(comm_type="a2a", query_groups=2), ["--num-query-groups", "--context-parallel-size"]),
    (dict(comm_type="a2a", query_groups=8, tensor_parallel=4), ["--num-attention-heads", "--tensor-model-parallel-size"]),
    (dict(comm_type="a2a+p2p", hierarchical_sizes=(2, 3)), ["--hierarchical-context-parallel-sizes",
                                                            "--context-parallel-size 4"]),
    (dict(comm_type="a2a+p2p"), ["--hierarchical-context-parallel-sizes"]),
    (dict(comm_type="a2a+p2p", hierarchical_sizes=(4, 1), query_groups=2), ["--num-query-groups",
                                                                            "--hierarchical-context-parallel-sizes"]),
    (dict(attention_dropout=0.1), ["--attention-dropout 0.1", "--context-parallel-size 4"]),
    (dict(comm_type="ring"), ["--cp-comm-type ring"]),
])
def test_refused_in_one_sentence(change, words):
    with pytest.raises(ConfigError) as error:
        check_context_parallel(**{**GOOD, **change})
    message = str(error.value)
    assert all(word in message for word in words), message
    assert message.count(". ") == 0 and "\n" not in message


@pytest.mark.parametrize("change", [{}, dict(comm_type="a2a"), dict(comm_type="a2a+p2p", hierarchical_sizes=(2, 2)),
                                    dict(context=1, attention_dropout=0.1, seq_length=7)])
def test_accepted(change):
    check_context_parallel(**{**GOOD, **change})


def test_local_length_must_match_the_sequence():
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ConfigError, match="--seq-length 12"):
        context_attention(q, q, q, ContextGroups.single(), seq_length=12, causal=True, scale=1.0)
