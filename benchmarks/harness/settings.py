"""The sizes of a distributed benchmark: a GPT (untied embeddings, no dropout, fp32) and its run.

The defaults are the pipelining benchmarks' model (``bench_pipeline.py``, ``bench_data_parallel.py``
and ``bench_trainer_overhead.py`` share it); other benchmarks pass their own sizes, and add their
own knobs by subclassing (one frozen dataclass, so the settings travel to spawned ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megapipe.config import ModelConfig


@dataclass(frozen=True)
class Settings:
    num_layers: int = 8
    hidden_size: int = 256
    num_attention_heads: int = 4
    seq_length: int = 128
    vocab_size: int = 1024
    micro_batch_size: int = 2
    num_microbatches: int = 8
    warmup_steps: int = 2  # per system; their losses are the equality checks
    rounds: int = 6  # timed steps (or blocks) per system
    tied: bool = False  # tied input and output embeddings

    def model_config(self, tied: Optional[bool] = None) -> ModelConfig:
        """No dropout (the paired systems must compute the same function); embeddings untied unless
        ``tied`` (PyTorch's schedules have no gradient reduction for a weight shared by two stages)."""
        tied = self.tied if tied is None else tied
        return ModelConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                           num_attention_heads=self.num_attention_heads, vocab_size=self.vocab_size,
                           seq_length=self.seq_length, hidden_dropout=0.0, attention_dropout=0.0,
                           untie_embeddings_and_output_weights=not tied)

    def describe_model(self) -> str:
        return (f"GPT, {self.num_layers} layers, hidden {self.hidden_size}, {self.num_attention_heads} heads, "
                f"seq {self.seq_length}, vocab {self.vocab_size}, fp32")

    @property
    def activation_shape(self) -> tuple[int, int, int]:
        """``[s, b, h]`` of a stage boundary, as ``PipelineEngine`` takes it."""
        return self.seq_length, self.micro_batch_size, self.hidden_size
