"""Autoregressive generation on any (t, p) layout, with a KV cache and a pipelined decode.

Every rank runs ``generate`` with the same prompts. The batch is split into microbatches that
move through the pipeline one after the other: while the last stage samples microbatch j's
next token, the earlier stages already compute microbatches j+1, j+2, ... With as many
microbatches as stages every stage is busy at every step (the naive decode, one microbatch,
leaves p-1 of p stages idle). Messages (``PeerMessages``): the first stage sends each step a
header (j + 1, or 0 to stop) and the hidden states down the pipeline; the last stage sends the
chosen tokens and done flags back to the first stage, which decides the next step. Each stage
knows which columns a microbatch's next step covers (one step moves them on by one), so the
header says only which microbatch comes. Sends are asynchronous and every pair of ranks
receives in the order it sent; at p = 2 the two directions share one pair of ranks, whose
messages NCCL runs in issue order, so there the first stage takes its pending answers before it
sends on (still after its own compute, which keeps both stages busy). Tensor ranks of a stage
compute the same thing in lockstep; the last stage gathers the vocabulary-parallel logits, so
each of its tensor ranks samples the same token.

Tokens, masks, done flags and generators live on the device; the host keeps column numbers. A
decode step reads the device only where a host decision needs it: a later stage reads the
header (which microbatch, or stop), and the first stage reads a microbatch's done flags when the
request has stop tokens (without them every row stops at the frame's end, a host number). Per
request, the frame and the stop ids go to the device and the answer (counts and tokens) comes back.

A ``Deadline`` (``deadline.py``) stops a generation early on every rank alike: the first stage
asks it before each round and, once it is reached, takes the answers in flight and sends the stop
header; each row keeps what it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megapipe.errors import UserError
from megapipe.config import ModelConfig
from megapipe.inference.deadline import Deadline
from megapipe.inference.frame import Frame
from megapipe.inference.kv_cache import KVCache
from megapipe.inference.sampling import SamplingParams, next_tokens, sequence_generators
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.peer_messages import PeerMessages
from megapipe.tensor_parallel.mappings import gather_from_tensor_parallel_region


class GenerationError(UserError, ValueError):
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
    """One slice of the request's rows, on the device: its frame, cache and generators, and where its
    decode stands (columns ``[first, end)`` are the next forward's inputs)."""

    frame: Frame
    params: SamplingParams
    stops: torch.Tensor  # the request's stop token ids
    cache: KVCache
    generators: list
    pad_id: int
    first: int = 0
    end: int = 0
    generated: torch.Tensor = field(default=None)  # [b] new tokens counted so far
    done: torch.Tensor = field(default=None)  # [b]

    def __post_init__(self):
        device = self.frame.tokens.device
        self.first, self.end = 0, self.frame.start
        self.generated = torch.zeros(self.size, dtype=torch.long, device=device)
        self.done = torch.zeros(self.size, dtype=torch.bool, device=device)

    @property
    def size(self) -> int:
        return self.frame.tokens.shape[0]

    @property
    def finished(self) -> bool:
        """Whether the microbatch is over."""
        if self.end >= self.frame.width:
            return True
        # with stop tokens, once a token was chosen: a read of the device (the decode's one synchronisation)
        return bool(self.params.stop_tokens) and self.end > self.frame.start and bool(self.done.all())

    def inputs(self) -> dict:
        self.cache.offset = self.first
        f = self.frame
        return {"tokens": f.tokens[:, self.first:self.end], "position_ids": f.positions[:, self.first:self.end],
                "attention_mask": f.attention_mask(self.first, self.end), "kv_cache": self.cache,
                "last_logits_only": True}

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The token of column ``end`` for each row, from the logits of column ``end - 1``; [b, 2] (token, done)."""
        f, col = self.frame, self.end
        sampled = next_tokens(logits, f.tokens[:, :col], ~f.pad[:, :col], self.params, self.generators)
        forced = f.is_prompt[:, col]
        new = torch.where(forced, f.tokens[:, col], sampled).masked_fill(self.done, self.pad_id)
        counted = ~forced & ~self.done
        stop = torch.isin(new, self.stops)
        done = self.done | (counted & (stop | (self.generated + counted.long() >= self.params.max_new_tokens)))
        return torch.stack((new, done.long()), dim=1)

    def advance(self, chosen: torch.Tensor) -> None:
        """Write the chosen column and move to the next step."""
        self.frame.tokens[:, self.end] = chosen[:, 0]
        counted = ~self.frame.is_prompt[:, self.end] & ~self.done
        self.generated += counted.long()
        self.done = chosen[:, 1].bool()
        self.step()

    def step(self) -> None:
        """The next forward takes the column just chosen."""
        self.first, self.end = self.end, self.end + 1


def _logits(out: torch.Tensor, ps: ParallelState, config: ModelConfig) -> torch.Tensor:
    """The last column's logits over the whole real vocabulary, [b, V]."""
    full = gather_from_tensor_parallel_region(out[:, -1], ps.tp_group) if ps.tp_size > 1 else out[:, -1]
    return full[:, : config.vocab_size]


def generate(chunks: list, ps: ParallelState, config: ModelConfig, prompts: list, params: SamplingParams,
             padding: str = "left", microbatches: Optional[int] = None, pad_id: int = 0,
             deadline: Optional[Deadline] = None) -> Optional[list]:
    """New tokens for each prompt (token id lists); None on middle pipeline stages, which never see them.

    ``microbatches``: sequences in flight (default: one microbatch per pipeline stage, the
    pipelined decode; 1 is the naive decode). ``deadline``: given on every rank or on none; when
    reached, every row ends with the tokens chosen so far and ``deadline.cut`` is set.
    """
    check_request(prompts, params, config, padding)
    if len(chunks) != 1:
        raise GenerationError("generation runs one model chunk per pipeline rank; drop "
                              "--num-layers-per-virtual-pipeline-stage.")
    model = chunks[0]
    model.eval()
    device = next(model.parameters()).device
    frame = Frame.build(prompts, params.max_new_tokens, padding, pad_id).to(device)
    stops = torch.tensor(params.stop_tokens, dtype=torch.long).to(device)
    count = max(1, min(microbatches or ps.pp_size, len(prompts)))
    bounds = [round(i * len(prompts) / count) for i in range(count + 1)]
    batches = [Microbatch(frame.rows(slice(a, b)), params, stops, KVCache(frame.width),
                          sequence_generators(params.seed, range(a, b), device), pad_id)
               for a, b in zip(bounds, bounds[1:])]
    link = PeerMessages(ps, device)
    with torch.inference_mode():
        if ps.is_first_stage:
            _drive(model, ps, config, batches, link, deadline)
        else:
            _follow(model, ps, config, batches, link)
    link.finish()
    if not (ps.is_first_stage or ps.is_last_stage):
        return None
    return frame.new_tokens(torch.cat([mb.generated for mb in batches]).cpu().tolist())


def _drive(model, ps, config, batches, link, deadline: Optional[Deadline]) -> None:
    """The first stage: runs each unfinished microbatch in turn, waiting for its previous token; stops
    early, after the answers in flight, when ``deadline`` is reached before a round."""
    in_flight: list[int] = []  # microbatches sent down the pipeline, oldest first

    def take_answer():  # the last stage answers in the order it was asked
        k = in_flight.pop(0)
        batches[k].advance(link.recv((batches[k].size, 2), torch.long, ps.prev_rank, "chosen tokens"))

    active = [not mb.finished for mb in batches]
    while any(active):
        if deadline is not None and deadline.reached(ps, link.device):
            while in_flight:
                take_answer()
            break
        for j, mb in enumerate(batches):
            if not active[j]:
                continue
            while j in in_flight:
                take_answer()
            if mb.finished:
                active[j] = False
                continue
            out = model(None, mb.inputs())
            if ps.is_last_stage:
                mb.advance(mb.choose(_logits(out, ps, config)))
                continue
            while in_flight and ps.next_rank == ps.prev_rank:  # p = 2: NCCL runs the pair's messages in order
                take_answer()
            link.send_int(j + 1, ps.next_rank, "step header")
            link.send(out, ps.next_rank, "hidden states")
            in_flight.append(j)
    if not ps.is_last_stage:
        link.send_int(0, ps.next_rank, "stop header")


def _follow(model, ps, config, batches, link) -> None:
    """Later stages: compute whatever arrives; the last stage answers with the chosen tokens."""
    while True:
        j = link.recv_int(ps.prev_rank, "step header") - 1  # a read of the device: what to compute, or stop
        if j < 0:
            if not ps.is_last_stage:
                link.send_int(0, ps.next_rank, "stop header")
            return
        mb = batches[j]
        hidden = link.recv((mb.end - mb.first, mb.size, config.hidden_size), config.params_dtype, ps.prev_rank,
                           "hidden states")
        out = model(hidden, mb.inputs())
        if ps.is_last_stage:
            chosen = mb.choose(_logits(out, ps, config))
            link.send(chosen, ps.next_rank, "chosen tokens")
            mb.advance(chosen)
        else:
            link.send_int(j + 1, ps.next_rank, "step header")
            link.send(out, ps.next_rank, "hidden states")
            mb.step()
