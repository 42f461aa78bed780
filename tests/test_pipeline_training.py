"""Pipelined training equals single-process training with gradient accumulation.

For every flush schedule (GPipe, 1F1B, interleaved 1F1B with v=2), pipeline sizes 2 and 4,
tensor sizes 1 and 2 and data sizes 1 and 2 (worlds of 4 and 8 processes), GPT and BERT (and, in
the world of 4, a Llama-shaped GPT: RoPE, SwiGLU, grouped-query attention, RMSNorm, no biases):
the per-microbatch losses and every parameter after 3 optimizer steps equal those of one
process that accumulates gradients over the same m x d microbatches from the same initial
weights. SGD with momentum: its update is linear in the gradient, so fp32 rounding
differences (summation order of split matmuls and all-reduces, ~1e-7 relative) stay of that
size; 1e-5 relative leaves room for 3 steps of accumulation.
"""

import datetime

import pytest
import torch
import torch.distributed as dist

from batch_helpers import random_microbatch
from model_families import MODEL_KIND, family_config
from megapipe.config import ModelConfig
from megapipe.data.context_batch import context_share
from megapipe.models import build_model_chunks
from megapipe.models.moe import set_aux_loss_scale
from megapipe.checkpointing.state import param_entries
from megapipe.models.state_dict import canonical_state_dict, canonical_tensor, local_state_dict
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.schedules.actions import Schedule
from megapipe.schedules.catalog import schedule_descriptor
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

RTOL = 1e-5
SEQ, MICRO, M, STEPS = 8, 2, 4, 3
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]


def model_config(kind: str, recompute: bool = False, num_layers: int = 8, dtype=torch.float32) -> ModelConfig:
    """The test model; ``recompute`` checkpoints every layer (its gradients are bit-for-bit those without)."""
    fields = dict(num_layers=num_layers, hidden_size=32, num_attention_heads=4, vocab_size=97, seq_length=SEQ,
                  hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8, params_dtype=dtype)
    if recompute:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if kind == "llama":
        fields.update(untie_embeddings_and_output_weights=True, ffn_hidden_size=48)
    return family_config(kind, **fields)


def optimizer_config() -> OptimizerConfig:
    return OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.9, weight_decay=0.0, clip_grad=0.0)


def microbatch(kind: str, config: ModelConfig, step: int, index: int) -> dict:
    return random_microbatch(MODEL_KIND[kind], config.vocab_size, MICRO, SEQ, seed=1000 * step + index)


def reference_run(kind: str, d: int, m: int = M, microbatch=microbatch, num_layers: int = 8):
    """One process, gradient accumulation over the m x d microbatches of each step."""
    config = model_config(kind, num_layers=num_layers)
    ps = ParallelState.single()
    model = build_model_chunks(MODEL_KIND[kind], config, ps)[0]
    set_aux_loss_scale(model, torch.tensor(1.0 / (m * d)))  # MoE: the balancing losses weigh as the main loss
    initial = canonical_state_dict([model], ps, config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        step_losses = []
        for index in range(m * d):
            loss = model(None, microbatch(kind, config, step, index))
            (loss / (m * d)).backward()
            step_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
    return initial, losses, canonical_state_dict([model], ps, config)


def shared_references(runs: list[tuple]) -> dict:
    """``reference_run(*run)`` for each of ``runs``, each computed by one rank of the world in turn and gathered
    by every rank: a reference is the same on every rank, so it is computed once, not once per rank."""
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = {run: reference_run(*run) for index, run in enumerate(runs) if index % size == rank}
    gathered = [None] * size
    dist.all_gather_object(gathered, mine)
    return {run: reference for part in gathered for run, reference in part.items()}


def pipelined_run(kind, t, p, d, schedule, v, initial, recompute=False, m=M, layout=None, microbatch=microbatch,
                  optimizer=None, num_layers=8, sequence_parallel=False, dtype=torch.float32, skipped=None):
    """``layout``: further keyword arguments of ``ParallelState.initialize``: context parallelism (``context``,
    ``cp_comm_type``, ``hierarchical_context``), under which each context rank trains on its chunks of the
    microbatches, and experts (``expert``). ``sequence_parallel`` splits each rank's sequence over its tensor
    group between the blocks; ``dtype`` is the parameters' (bf16 or fp16 with ``optimizer``'s flag for it), and
    ``skipped`` a list to which each step appends whether it skipped its update (an fp16 overflow). The final
    parameters are the optimizer's main weights: bf16 and fp16 weights' fp32 masters."""
    config = model_config(kind, recompute, num_layers, dtype)
    placement = schedule.placement if isinstance(schedule, Schedule) else schedule_descriptor(schedule).placement
    ps = ParallelState.initialize(tensor=t, pipeline=p, virtual_pipeline=v, placement=placement, **(layout or {}))
    chunks = build_model_chunks(MODEL_KIND[kind], config, ps, sequence_parallel=sequence_parallel)
    for chunk in chunks:
        chunk.load_state_dict(local_state_dict(initial, chunk, ps, config))
    local = SEQ // ps.cp_size // (t if sequence_parallel else 1)
    engine = PipelineEngine(chunks, ps, optimizer or optimizer_config(), schedule, m, (local, MICRO, config.hidden_size),
                            dtype=dtype, scatter_gather=not sequence_parallel, timeout=datetime.timedelta(seconds=60))
    losses = []
    for step in range(STEPS):
        batches = [context_share(microbatch(kind, config, step, ps.dp_rank * m + i), SEQ, ps) for i in range(m)]
        result = engine.train_batch(batches)
        losses.append(result.losses)
        if skipped is not None:
            skipped.append(not result.step.ok)
    final = {}
    with engine.whole_weights():  # ZeRO-3 releases the weights between passes
        for entry in param_entries(chunks, engine.optimizer):
            key, full = canonical_tensor(entry.name, entry.main.detach(), entry.param, ps, config)
            final[key] = full.clone()
    return ps, losses, final


def assert_close(actual, expected, what):
    expected = torch.as_tensor(expected)
    actual = torch.as_tensor(actual)
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


def assert_matches_reference(ps, losses, final, reference, what, m=M):
    """A pipelined run equals its reference: the last stage's losses of its data-parallel share of
    the m microbatches per replica, every step, and every final parameter on every rank."""
    _, ref_losses, ref_final = reference
    if ps.is_last_stage:
        for step in range(STEPS):
            expected = ref_losses[step][ps.dp_rank * m:(ps.dp_rank + 1) * m]
            assert_close(losses[step], expected, f"{what} losses of step {step}")
    for name, value in final.items():
        assert_close(value, ref_final[name], f"{what} parameter {name}")


def check_layouts(rank, world_size, layouts, kinds):
    checked = []
    references = shared_references([(kind, d) for kind in kinds for d in sorted({d for _, _, d in layouts})])
    for kind in kinds:
        for t, p, d in layouts:
            for schedule, v in SCHEDULES:
                what = f"{kind} {schedule} v={v} t={t} p={p} d={d}"
                ps, losses, final = pipelined_run(kind, t, p, d, schedule, v, references[kind, d][0])
                assert_matches_reference(ps, losses, final, references[kind, d], what)
                checked.append(what)
    return checked


@pytest.mark.parametrize("world,layouts,kinds", [
    (4, [(1, 2, 2), (2, 2, 1), (1, 4, 1)], ("gpt", "bert", "llama")),
    (8, [(2, 4, 1), (2, 2, 2), (1, 4, 2)], ("gpt", "bert")),
])
def test_flush_schedules_match_gradient_accumulation(world, layouts, kinds):
    results = run_distributed(world, check_layouts, layouts, kinds, timeout=600)
    assert len(results[0]) == len(kinds) * len(layouts) * len(SCHEDULES)
