"""Training with experts split over 2 expert ranks (each also a data-parallel replica of the dense layers)
updates the weights as single-process gradient accumulation does, at every sharding level, and reports its
gradient norm: the experts' gradients are reduced over their own group and counted once in the norm."""

import datetime

import pytest
import torch
from test_moe_layer import moe_config

from megapipe.config import OptimizerConfig
from megapipe.models import build_model_chunks
from megapipe.models.moe import set_aux_loss_scale
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

LEVELS = ("no_shard", "optim", "optim_grads_params")


def _microbatches(config) -> list[dict]:
    g = torch.Generator().manual_seed(9)
    return [{"tokens": torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g),
             "labels": torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g),
             "loss_mask": torch.ones(2, config.seq_length)} for _ in range(4)]


def _reference(config) -> tuple[dict, float]:
    """Each parameter's gradient accumulated over all 4 microbatches on one process, and their global norm."""
    reference = build_model_chunks("gpt", config, ParallelState.single())[0].train()
    set_aux_loss_scale(reference, torch.tensor(0.25))
    for microbatch in _microbatches(config):
        (reference(None, microbatch) / 4).backward()
    grads = {name: p.grad for name, p in reference.named_parameters()}
    return grads, torch.sqrt(sum(g.square().sum() for g in grads.values())).item()


def _differences(rank: int, world: int, dispatch: dict) -> dict:
    """Per sharding level: the largest error of an update (SGD, learning rate 1: minus the gradient) relative
    to the largest gradient element, and the gradient norm's relative error."""
    config = moe_config(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.1, untie_embeddings_and_output_weights=True,
                        **dispatch)
    grads, norm = _reference(config)
    largest = max(g.abs().max().item() for g in grads.values())
    ps = ParallelState.initialize(expert=2)
    out = {}
    for level in LEVELS:
        sgd = OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0,
                              data_parallel_sharding_strategy=level)
        engine = PipelineEngine(build_model_chunks("gpt", config, ps), ps, sgd, "1f1b", 2,
                                (config.seq_length, 2, config.hidden_size), timeout=datetime.timedelta(seconds=60))
        with engine.whole_weights():
            before = {name: p.detach().clone() for name, p in engine.chunks[0].named_parameters()}
        step = engine.train_batch(_microbatches(config)[2 * rank:2 * rank + 2]).step  # this replica's half
        worst = 0.0
        with engine.whole_weights():
            for name, param in engine.chunks[0].named_parameters():
                want = grads[name][2 * rank:2 * rank + 2] if ".experts." in name else grads[name]
                worst = max(worst, (before[name] - param.detach() - want).abs().max().item() / largest)
        out[level] = (worst, abs(float(step.grad_norm) - norm) / norm)
    return out


@pytest.mark.parametrize("dispatch", [dict(moe_token_dispatcher_type="alltoall"),
                                      dict(moe_token_dispatcher_type="allgather"),
                                      dict(moe_grouped_gemm=True, moe_dropless_device_dispatch=True)],
                         ids=["alltoall", "allgather", "dropless"])
def test_expert_parallel_training_equals_accumulation_at_every_sharding_level(dispatch):
    for rank, result in enumerate(run_distributed(2, _differences, dispatch, timeout=180)):
        for level in LEVELS:
            update, norm = result[level]
            assert update < 1e-5 and norm < 1e-6, (rank, level, update, norm)
