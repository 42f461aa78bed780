"""Autoregressive generation on any (t, p) layout, with a KV cache and a pipelined decode.

Every rank runs ``generate`` with the same prompts. The batch is split into microbatches that
move through the pipeline one after the other: while the last stage samples microbatch j's
next token, the earlier stages already compute microbatches j+1, j+2, ... With as many
microbatches as stages every stage is busy at every step (the naive decode, one microbatch,
leaves p-1 of p stages idle). Messages: the first stage sends each step a header (go, j,
first column, end column) and the hidden states down the pipeline; the last stage sends the
chosen tokens and done flags back to the first stage, which decides the next step. All sends
are asynchronous and every pair of ranks receives in the order it sent, so no order of
arrival can deadlock. Tensor ranks of a stage compute the same thing in lockstep; the last
stage gathers the vocabulary-parallel logits, so each of its tensor ranks samples the same token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.config import ModelConfig
from megapipe.inference.frame import Frame
from megapipe.inference.kv_cache import KVCache
from megapipe.inference.sampling import SamplingParams, next_tokens
from megapipe.parallel_state import ParallelState
from megapipe.tensor_parallel.mappings import gather_from_tensor_parallel_region


class GenerationError(ValueError):
    """A request that cannot be served; the message is one sentence naming the field and the fix."""


def check_request(prompts: list, params: SamplingParams, config: ModelConfig, padding: str) -> None:
    """Refuse, in one sentence, what generation cannot do."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("prompts must be a non-empty list of non-empty prompts.")
    if padding not in ("left", "right"):
        raise GenerationError(f"padding {padding!r} is unknown; use left or right.")
    if params.max_new_tokens < 1:
        raise GenerationError(f"tokens_to_generate {params.max_new_tokens} must be at least 1.")
    if params.temperature < 0:
        raise GenerationError(f"temperature {params.temperature} must be at least 0 (0 is greedy).")
    if params.top_k < 0 or not 0.0 <= params.top_p <= 1.0:
        raise GenerationError(f"top_k {params.top_k} must be at least 0 and top_p {params.top_p} within [0, 1].")
    if params.repetition_penalty <= 0:
        raise GenerationError(f"repetition_penalty {params.repetition_penalty} must be positive (1 is none).")
    longest = max(len(p) for p in prompts)
    limit = config.max_position_embeddings
    if longest > limit:
        raise GenerationError(f"a prompt of {longest} tokens is longer than --max-position-embeddings {limit}; "
                              "shorten the prompt.")
    if longest + params.max_new_tokens > limit:
        raise GenerationError(f"a prompt of {longest} tokens plus {params.max_new_tokens} new tokens exceeds "
                              f"--max-position-embeddings {limit}; generate at most {limit - longest} tokens.")
    bad = [t for p in prompts for t in p if not 0 <= t < config.vocab_size]
    if bad:
        raise GenerationError(f"token id {bad[0]} is outside the vocabulary of {config.vocab_size}.")


@dataclass
class Microbatch:
    """One slice of the request's rows, its cache and where its decode stands."""

    rows: slice
    frame: Frame
    params: SamplingParams
    cache: KVCache
    generators: list
    pad_id: int
    first: int = 0  # columns [first, end) are the next forward's inputs
    end: int = 0
    generated: torch.Tensor = field(default=None)
    done: torch.Tensor = field(default=None)

    def __post_init__(self):
        self.first, self.end = 0, self.frame.start
        self.generated = torch.zeros(self.size, dtype=torch.long)
        self.done = torch.zeros(self.size, dtype=torch.bool)

    @property
    def size(self) -> int:
        return self.frame.tokens.shape[0]

    @property
    def finished(self) -> bool:
        return bool(self.done.all()) or self.end >= self.frame.tokens.shape[1]

    def inputs(self, device) -> dict:
        self.cache.offset = self.first
        f = self.frame
        return {"tokens": f.tokens[:, self.first:self.end].to(device),
                "position_ids": f.positions[:, self.first:self.end].to(device),
                "attention_mask": f.attention_mask(self.first, self.end).to(device),
                "kv_cache": self.cache, "last_logits_only": True}

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The token of column ``end`` for each row, from the logits of column ``end - 1``; [b, 2] (token, done)."""
        f, col = self.frame, self.end
        sampled = next_tokens(logits, f.tokens[:, :col], ~f.pad[:, :col], self.params, self.generators)
        forced = f.is_prompt[:, col]
        new = torch.where(forced, f.tokens[:, col], sampled.cpu())
        new = torch.where(self.done, torch.full_like(new, self.pad_id), new)
        counted = ~forced & ~self.done
        stop = torch.isin(new, torch.tensor(list(self.params.stop_tokens), dtype=torch.long))
        done = self.done | (counted & (stop | (self.generated + counted.long() >= self.params.max_new_tokens)))
        return torch.stack((new, done.long()), dim=1)

    def advance(self, chosen: torch.Tensor) -> None:
        """Write the chosen column and move to the next step."""
        self.frame.tokens[:, self.end] = chosen[:, 0]
        counted = ~self.frame.is_prompt[:, self.end] & ~self.done
        self.generated += counted.long()
        self.done = chosen[:, 1].bool()
        self.first, self.end = self.end, self.end + 1


class Link:
    """This rank's pipeline messages (asynchronous sends, in-order receives)."""

    def __init__(self, ps: ParallelState):
        self.ps = ps
        self.pending = []

    def send(self, tensor: torch.Tensor, to: int) -> None:
        self.pending = [(work, sent) for work, sent in self.pending if not work.is_completed()]
        self.pending.append((dist.isend(tensor.contiguous(), to), tensor))

    def recv(self, shape, dtype, source: int, device) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, source)
        return tensor

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _logits(out: torch.Tensor, ps: ParallelState, config: ModelConfig) -> torch.Tensor:
    """The last column's logits over the whole real vocabulary, [b, V]."""
    full = gather_from_tensor_parallel_region(out[:, -1], ps.tp_group) if ps.tp_size > 1 else out[:, -1]
    return full[:, : config.vocab_size]


def generate(chunks: list, ps: ParallelState, config: ModelConfig, prompts: list, params: SamplingParams,
             padding: str = "left", microbatches: Optional[int] = None, pad_id: int = 0) -> Optional[list]:
    """New tokens for each prompt (token id lists); None on middle pipeline stages, which never see them.

    ``microbatches``: sequences in flight (default: one microbatch per pipeline stage, the
    pipelined decode; 1 is the naive decode).
    """
    check_request(prompts, params, config, padding)
    if len(chunks) != 1:
        raise GenerationError("generation runs one model chunk per pipeline rank; drop "
                              "--num-layers-per-virtual-pipeline-stage.")
    model = chunks[0]
    model.eval()
    frame = Frame.build(prompts, params.max_new_tokens, padding, pad_id)
    count = max(1, min(microbatches or ps.pp_size, len(prompts)))
    bounds = [round(i * len(prompts) / count) for i in range(count + 1)]
    device = next(model.parameters()).device
    batches = [Microbatch(slice(a, b), frame.rows(slice(a, b)), params, KVCache(frame.tokens.shape[1]),
                          [torch.Generator().manual_seed(params.seed + row) for row in range(a, b)], pad_id)
               for a, b in zip(bounds, bounds[1:])]
    link = Link(ps)
    with torch.inference_mode():
        if ps.is_first_stage:
            _drive(model, ps, config, batches, link, device)
        else:
            _follow(model, ps, config, batches, link, device)
    link.finish()
    if not (ps.is_first_stage or ps.is_last_stage):
        return None
    counts = torch.cat([mb.generated for mb in batches]).tolist()
    return [frame.generated(row, count) for row, count in enumerate(counts)]


def _drive(model, ps, config, batches, link, device) -> None:
    """The first stage: runs each unfinished microbatch in turn, waiting for its previous token."""
    in_flight: list[int] = []
    active = [not mb.finished for mb in batches]
    while any(active):
        for j, mb in enumerate(batches):
            if not active[j]:
                continue
            while j in in_flight:  # the last stage answers in the order it was asked
                k = in_flight.pop(0)
                batches[k].advance(link.recv((batches[k].size, 2), torch.long, ps.prev_rank, "cpu"))
            if mb.finished:
                active[j] = False
                continue
            out = model(None, mb.inputs(device))
            if ps.is_last_stage:
                mb.advance(mb.choose(_logits(out, ps, config)))
                continue
            link.send(torch.tensor([1, j, mb.first, mb.end]), ps.next_rank)
            link.send(out, ps.next_rank)
            in_flight.append(j)
    if not ps.is_last_stage:
        link.send(torch.tensor([0, 0, 0, 0]), ps.next_rank)


def _follow(model, ps, config, batches, link, device) -> None:
    """Later stages: compute whatever arrives; the last stage answers with the chosen tokens."""
    while True:
        go, j, first, end = link.recv((4,), torch.long, ps.prev_rank, "cpu").tolist()
        if not go:
            if not ps.is_last_stage:
                link.send(torch.tensor([0, 0, 0, 0]), ps.next_rank)
            return
        mb = batches[j]
        mb.first, mb.end = first, end
        hidden = link.recv((end - first, mb.size, config.hidden_size), config.params_dtype, ps.prev_rank, device)
        out = model(hidden, mb.inputs(device))
        if ps.is_last_stage:
            chosen = mb.choose(_logits(out, ps, config))
            link.send(chosen, ps.next_rank)
            mb.advance(chosen)
        else:
            link.send(torch.tensor([1, j, first, end]), ps.next_rank)
            link.send(out, ps.next_rank)
