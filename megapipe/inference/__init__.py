"""Inference: KV cache, sampling, (pipelined) generation, log-likelihood scoring, the REST server."""

from megapipe.inference.generation import GenerationError, SamplingParams, generate
from megapipe.inference.scoring import score_continuations

__all__ = ["GenerationError", "SamplingParams", "generate", "score_continuations"]
