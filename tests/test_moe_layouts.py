"""MoE models at (t, p, e) = (2, 1, 1), (1, 2, 1) and (1, 1, 2) in a world of 2 ranks, and Mixtral at
(2, 1, 2) and (1, 2, 2) in a world of 4, and at t = 2 with whole experts (``--expert-tensor-parallel-size 1``)
at e = 1 and e = 2 in the world of 2.

The models of ``test_moe_hf.py`` are imported as checkpoints of another layout (t = 2) and loaded at
each layout: logits equal transformers' within 1e-5 of their scale and greedy generation equals
``generate`` token for token. Under t = 2 every tensor rank holds half of each expert's ffn and the
whole router; at e = 2 each rank holds half of the experts and the tokens travel to them by
all-to-all. With whole experts at t = 2 each tensor rank takes half the tokens (of a decoding step's one
token per sequence too) to the experts and the halves' outputs are summed. OLMoE's q/k norm over the whole projections needs t = 1, so it runs at t = 1 only.

One 1F1B step of 4 microbatches at p = 2 (an MoE layer on each stage, auxiliary and z losses on)
moves every weight as single-process gradient accumulation does: the engine gives the losses
attached on either stage the main loss's gradient scale, 1/4.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from test_moe_hf import MODELS, NEW, RTOL, VOCAB, hf_model, prompts, reference_generation
from test_moe_layer import moe_config

from megapipe.checkpointing.common import Common, SavedLayout
from megapipe.checkpointing.convert import import_hf_checkpoint
from megapipe.checkpointing.load import load_weights
from megapipe.checkpointing.paths import find_checkpoint
from megapipe.inference import SamplingParams, generate
from megapipe.inference.scoring import pipeline_logits
from megapipe.config import OptimizerConfig
from megapipe.models import build_model_chunks
from megapipe.models.moe import set_aux_loss_scale
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

# (t, p, e, expert-tensor size), by world size; whole experts on each tensor rank (etp = 1) with and without
# expert parallelism, each tensor rank taking half the tokens: Mixtral shows it
LAYOUTS = {2: ((2, 1, 1, 2), (1, 2, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1), (2, 1, 1, 1)), 4: ((2, 1, 2, 2), (1, 2, 2, 1))}
TOKENS = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(2))


def _layouts(name: str, world: int):
    if world > 2 and name != "mixtral":  # expert parallelism composed with t or p: one model shows it
        return []
    return [(t, p, e, etp) for t, p, e, etp in LAYOUTS[world]
            if not (name == "olmoe" and t > 1) and (etp == t or name == "mixtral")]


def _layout_checks(rank, world_size, checkpoints):
    out = {}
    for layout in LAYOUTS[world_size]:
        t, p, e, etp = layout
        ps = ParallelState.initialize(t, p, expert=e, expert_tensor=etp)
        for name, directory in checkpoints.items():
            if layout not in _layouts(name, world_size):
                continue
            config = Common.read(find_checkpoint(directory)).model_config
            chunk = build_model_chunks("gpt", config, ps)[0].eval()
            load_weights(directory, "gpt", [chunk], ps, config)
            with torch.no_grad():
                logits = pipeline_logits(chunk, ps, config, TOKENS)
            if logits is not None and ps.tp_rank == 0:
                out[("logits", name, layout)] = logits[..., :VOCAB]
            greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0)
            out[("greedy", name, layout, rank)] = generate([chunk], ps, config, prompts(), greedy, padding="left")
        dist.barrier()
    if world_size == 2:
        out[("step", rank)] = _pipelined_step_matches_accumulation()
    return out


def _microbatches(config):
    g = torch.Generator().manual_seed(9)
    return [{"tokens": torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g),
             "labels": torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g),
             "loss_mask": torch.ones(2, config.seq_length)} for _ in range(4)]


def _pipelined_step_matches_accumulation() -> float:
    """The largest difference between the weights after one 1F1B step at p = 2 and after single-process
    accumulation over the same 4 microbatches (SGD, learning rate 1: the weights move by the gradient)."""
    config = moe_config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1, untie_embeddings_and_output_weights=True)
    sgd = OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0)
    ps = ParallelState.initialize(pipeline=2)
    engine = PipelineEngine(build_model_chunks("gpt", config, ps), ps, sgd, "1f1b", 4,
                            (config.seq_length, 2, config.hidden_size), timeout=datetime.timedelta(seconds=60))
    engine.train_batch(_microbatches(config))
    reference = build_model_chunks("gpt", config, ParallelState.single())[0].train()
    set_aux_loss_scale(reference, torch.tensor(0.25))
    for microbatch in _microbatches(config):
        (reference(None, microbatch) / 4).backward()
    expected = {name: p.detach() - p.grad for name, p in reference.named_parameters()}
    return max((p.detach() - expected[name]).abs().max().item() for name, p in engine.chunks[0].named_parameters())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-layouts")
    models, checkpoints = {}, {}
    for seed, name in enumerate(MODELS):
        models[name] = hf_model(name, seed)
        models[name].save_pretrained(root / f"{name}-hf")
        checkpoints[name] = str(root / name)
        saved_t = 1 if name == "olmoe" else 2
        import_hf_checkpoint(str(root / f"{name}-hf"), checkpoints[name], SavedLayout(saved_t, 1, 1))
    results = {}
    for size in LAYOUTS:
        for rank_results in run_distributed(size, _layout_checks, checkpoints, timeout=300):
            results.update(rank_results)
    return models, results


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_greedy_generation_equal_transformers_at_other_layouts(world, name):
    models, results = world
    with torch.no_grad():
        expected = models[name](TOKENS).logits
    generated = reference_generation(models[name])
    for size in LAYOUTS:
        for layout in _layouts(name, size):
            torch.testing.assert_close(results[("logits", name, layout)], expected, rtol=RTOL,
                                       atol=RTOL * expected.abs().max().item())
            for rank in range(size):
                assert results[("greedy", name, layout, rank)] == generated, (layout, rank)


def test_a_pipelined_step_attaches_the_auxiliary_losses_with_the_main_loss_scale(world):
    _, results = world
    assert max(results[("step", rank)] for rank in range(2)) < 1e-6
