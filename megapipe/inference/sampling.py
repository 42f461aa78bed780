"""Next-token choice from logits: repetition penalty, temperature, top-k, top-p, greedy.

The order is Hugging Face's (penalty, then temperature, top-k, top-p). Each sequence draws
from its own generator, seeded from the request's seed and the sequence's index in the
request, so a sampled continuation does not depend on how the batch was split into
microbatches or on the parallel layout. Everything runs on the logits' device, generators
included, and nothing is read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: no limit; 1: greedy
    top_p: float = 0.0  # 0: no limit
    repetition_penalty: float = 1.0
    stop_tokens: tuple = ()
    seed: int = 1234

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def stop_tokens_or_end_of_text(given, tokenizer) -> tuple:
    """The token ids that end a sequence: ``given`` when not None, else the tokenizer's end-of-text token
    (as Megatron-LM's generation stops at its eod, and an exported model's ``eos_token_id`` does), else none."""
    if given is not None:
        return tuple(given)
    end_of_text = tokenizer.special_id("eod") if tokenizer is not None else None
    return () if end_of_text is None else (end_of_text,)


def sequence_generators(seed: int, rows: range, device: torch.device) -> list:
    """One generator per sequence of ``rows`` (indices in the request), on the device that samples."""
    return [torch.Generator(device=device).manual_seed(seed + row) for row in rows]


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, seen: torch.Tensor, penalty: float):
    """CTRL's penalty on every token already in a row's ``history`` (where ``seen`` is True)."""
    if penalty == 1.0:
        return logits
    present = torch.zeros_like(logits, dtype=torch.bool)
    present.scatter_(1, history.masked_fill(~seen, 0), seen)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(present, penalised, logits)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k and top-p (nucleus) filtering; removed tokens get -inf."""
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p > 0.0:
        ordered, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - params.top_p
        drop[..., -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, history: torch.Tensor, seen: torch.Tensor, params: SamplingParams,
                generators: list) -> torch.Tensor:
    """One token per row of ``logits`` [b, V]; ``history``, ``seen`` [b, n] are on the logits' device
    and ``generators`` holds one generator per row, on that device too."""
    logits = apply_repetition_penalty(logits.float(), history, seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(dim=-1)
    return draw(filter_logits(logits, params).softmax(dim=-1), generators)


def draw(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One index per row of ``probs`` [b, V], drawn as ``torch.multinomial`` draws one sample (the
    index of the largest p / q, q ~ Exp(1)), each row's noise from its own generator; unlike
    ``torch.multinomial`` it checks no probability on the host (a synchronisation in some PyTorch
    versions), and the batch takes one division and one argmax."""
    noise = torch.stack([torch.empty_like(row).exponential_(generator=g) for row, g in zip(probs, generators)])
    return (probs / noise).argmax(dim=-1)
