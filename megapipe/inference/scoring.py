"""Log-likelihood of continuations given contexts, for evaluation harnesses.

For each (context, continuation) pair of token id lists: the sum of log p(continuation token
| everything before it) and whether every continuation token is the greedy choice, the two
numbers harnesses such as lm-evaluation-harness ask a model for. Pairs are scored in one
right-padded batch; the forward pass crosses the pipeline stage by stage, and the answer is
broadcast from the last stage so every rank returns it. The batch goes to the device once and
the answer comes back to the host once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.config import ModelConfig
from megapipe.inference.generation import GenerationError
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.peer_messages import PeerMessages
from megapipe.tensor_parallel.mappings import gather_from_tensor_parallel_region


def check_pairs(pairs: list, config: ModelConfig) -> None:
    """Refuse, in one sentence, pairs that cannot be scored."""
    if not pairs:
        raise GenerationError("requests must be a non-empty list of [context, continuation] pairs.")
    for context, continuation in pairs:
        if not continuation or not context:
            raise GenerationError("each request needs a non-empty context and a non-empty continuation.")
        if len(context) + len(continuation) > config.max_position_embeddings:
            raise GenerationError(f"a context and continuation of {len(context) + len(continuation)} tokens exceed "
                                  f"--max-position-embeddings {config.max_position_embeddings}; shorten the context.")


def pipeline_logits(model, ps: ParallelState, config: ModelConfig, tokens: torch.Tensor):
    """Logits [b, s, V] of ``tokens`` on the last stage (None elsewhere): one forward down the pipeline."""
    device = next(model.parameters()).device
    link = PeerMessages(ps, device)
    hidden = None
    if not ps.is_first_stage:
        hidden = link.recv((tokens.shape[1], tokens.shape[0], config.hidden_size), config.params_dtype, ps.prev_rank,
                           "hidden states")
    out = model(hidden, {"tokens": tokens.to(device)})
    if not ps.is_last_stage:
        link.send(out, ps.next_rank, "hidden states")
        link.finish()
        return None
    full = gather_from_tensor_parallel_region(out, ps.tp_group) if ps.tp_size > 1 else out
    return full[..., : config.vocab_size].float()


def score_continuations(chunks: list, ps: ParallelState, config: ModelConfig, pairs: list) -> list:
    """[(log-likelihood, is_greedy)] per (context, continuation) pair, on every rank."""
    check_pairs(pairs, config)
    model = chunks[0]
    model.eval()
    sequences = [list(c) + list(x) for c, x in pairs]
    width = max(len(s) for s in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = torch.tensor(seq)
    tokens = tokens.to(next(model.parameters()).device)
    with torch.no_grad():
        logits = pipeline_logits(model, ps, config, tokens)
    result = [None]
    if logits is not None:
        logprobs = logits.log_softmax(dim=-1)
        sums, greedy = [], []
        for row, (context, continuation) in enumerate(pairs):
            span = slice(len(context) - 1, len(context) + len(continuation) - 1)
            target = tokens[row, span.start + 1:span.stop + 1]  # the continuation, on the device
            sums.append(logprobs[row, span].gather(1, target.unsqueeze(1)).sum())
            greedy.append((logprobs[row, span].argmax(dim=-1) == target).all())
        result[0] = list(zip(torch.stack(sums).cpu().tolist(), torch.stack(greedy).cpu().tolist()))
    if ps.pp_size > 1:
        dist.broadcast_object_list(result, src=ps.stage_rank(ps.pp_size - 1), group=ps.pp_group)
    return result[0]
