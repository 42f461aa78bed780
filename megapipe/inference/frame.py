"""The token frame of one generation request: prompts padded left or right, room for new tokens.

All rows share one frame of ``max prompt + max new`` columns. Left padding aligns the prompts'
ends, so every row starts generating at the same column; right padding aligns their starts,
and generation starts at the shortest prompt's end: a row whose prompt is longer keeps its
own tokens there (they are forced instead of sampled), as Megatron-LM does. Left pads are
masked out of attention and do not count as positions, so a row computes what it would alone.
A frame is built on the host and then lives on the device that generates, where every step
reads and writes it; the host keeps only plain numbers (the columns where prompts end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Frame:
    tokens: torch.Tensor  # [b, L] prompt tokens, then generated ones
    is_prompt: torch.Tensor  # [b, L] True where the column holds the row's prompt
    pad: torch.Tensor  # [b, L] True on left padding
    positions: torch.Tensor  # [b, L] position ids (left pads excluded)
    start: int  # the first column that is predicted
    ends: list  # per row, the column after its prompt

    @staticmethod
    def build(prompts: list, max_new_tokens: int, padding: str, pad_id: int) -> "Frame":
        lengths = [len(p) for p in prompts]
        width = max(lengths) + max_new_tokens
        tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        is_prompt = torch.zeros(len(prompts), width, dtype=torch.bool)
        pad = torch.zeros(len(prompts), width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            first = max(lengths) - len(prompt) if padding == "left" else 0
            tokens[row, first:first + len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            is_prompt[row, first:first + len(prompt)] = True
            pad[row, :first] = True
        positions = ((~pad).long().cumsum(dim=1) - 1).clamp(min=0)
        start = max(lengths) if padding == "left" else min(lengths)
        ends = [max(lengths) if padding == "left" else length for length in lengths]
        return Frame(tokens, is_prompt, pad, positions, start, ends)

    def to(self, device: torch.device) -> "Frame":
        return Frame(self.tokens.to(device), self.is_prompt.to(device), self.pad.to(device),
                     self.positions.to(device), self.start, self.ends)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def rows(self, rows: slice) -> "Frame":
        return Frame(self.tokens[rows], self.is_prompt[rows], self.pad[rows], self.positions[rows], self.start,
                     self.ends[rows])

    def attention_mask(self, first: int, end: int) -> torch.Tensor:
        """[b, 1, end - first, end], True where query column ``first + i`` may not see key column j."""
        query = torch.arange(first, end, device=self.pad.device).unsqueeze(1)
        key = torch.arange(end, device=self.pad.device).unsqueeze(0)
        return (key > query).unsqueeze(0).unsqueeze(0) | self.pad[:, None, None, :end]

    def new_tokens(self, counts: list) -> list:
        """Each row's first ``counts[row]`` tokens after its prompt, read on the host in one copy."""
        tokens = self.tokens.cpu()
        return [tokens[row, end:end + count].tolist() for row, (end, count) in enumerate(zip(self.ends, counts))]
