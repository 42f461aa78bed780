"""Context-parallel attention: the sequence split over c ranks (chunks i and 2c-1-i on rank i), each
rank's queries attending over the whole sequence by ring (p2p), all-gather, all-to-all over heads
(a2a) or both (a2a+p2p), through the fused kernels with their log-sum-exps (docs/context_parallel.md)."""

from megapipe.context_parallel.attention import context_attention
from megapipe.context_parallel.checks import check_context_parallel
from megapipe.context_parallel.timeline import Timeline

__all__ = ["Timeline", "check_context_parallel", "context_attention"]
