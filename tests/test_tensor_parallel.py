"""Tensor parallelism computes the same function as one process.

For t in {2, 4} (a world of 4 ranks: t=2 x d=2 and t=4), a GPT, a BERT and a Llama-shaped
GPT (RoPE, SwiGLU, grouped-query attention with 4 groups, RMSNorm, no biases but QKV's) built with
tensor (and optionally sequence) parallelism from the same canonical weights as a
single-process model give the same loss and, gathered to full tensors, the same gradients.
Tolerance 1e-5 relative: the split changes only the order of fp32 summations (partial
matmuls all-reduced), which moves results by a few ulps, ~1e-7 relative.
"""

import pytest
import torch
import torch.distributed as dist

from megapipe.parallel.collectives import group_size
from megapipe.config import ModelConfig
from megapipe.models import build_model_chunks
from megapipe.models.state_dict import canonical_state_dict, canonical_tensor, local_state_dict
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed
from model_families import MODEL_KIND, family_config

RTOL = 1e-5
SEQ = 12


def model_config(kind: str) -> ModelConfig:
    common = dict(num_layers=2, hidden_size=48, num_attention_heads=4, vocab_size=203, seq_length=SEQ,
                  hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
    if kind == "llama":  # 4 groups of 2 heads, so t = 4 holds one group each; half the channels rotated
        common.update(num_attention_heads=8, ffn_hidden_size=40, rotary_percent=0.5, num_query_groups=4,
                      add_qkv_bias=True, untie_embeddings_and_output_weights=True)
    return family_config(kind, **common)


def make_batch(kind: str, config: ModelConfig) -> dict:
    g = torch.Generator().manual_seed(7)
    b = 3
    tokens = torch.randint(0, config.vocab_size, (b, SEQ), generator=g)
    batch = {"tokens": tokens, "labels": torch.randint(0, config.vocab_size, (b, SEQ), generator=g),
             "loss_mask": (torch.rand(b, SEQ, generator=g) > 0.2).float()}
    if kind == "bert":
        padding = torch.ones(b, SEQ, dtype=torch.long)
        padding[1, 9:] = 0
        batch.update(types=torch.randint(0, 2, (b, SEQ), generator=g), padding_mask=padding,
                     is_random=torch.tensor([0, 1, 1]))
        batch["loss_mask"] = batch["loss_mask"] * padding
    return batch


def loss_and_grads(kind, config, ps, canonical, sequence_parallel=False):
    model = build_model_chunks(MODEL_KIND[kind], config, ps, sequence_parallel=sequence_parallel)[0]
    model.load_state_dict(local_state_dict(canonical, model, ps, config))
    loss = model(None, make_batch(kind, config))
    loss.backward()
    if sequence_parallel:  # replicated params saw a sequence slice: sum their grads over the tensor group
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False) and group_size(ps.tp_group) > 1:
                dist.all_reduce(p.grad, group=ps.tp_group)
    grads = {}
    for name, p in model.named_parameters():
        key, full = canonical_tensor(name, p.grad, p, ps, config)
        grads[key] = full
    return loss.detach(), grads


def assert_close(actual, expected, what):
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{what}: {m}")


def check_tensor_parallel(rank, world_size):
    for kind in ("gpt", "bert", "llama"):
        config = model_config(kind)
        single = ParallelState.single()
        reference = build_model_chunks(MODEL_KIND[kind], config, single)[0]
        canonical = canonical_state_dict([reference], single, config)
        ref_loss, ref_grads = loss_and_grads(kind, config, single, canonical)
        for t in (2, 4):
            ps = ParallelState.initialize(tensor=t)
            for sp in (False, True):
                loss, grads = loss_and_grads(kind, config, ps, canonical, sequence_parallel=sp)
                what = f"{kind} t={t} sequence_parallel={sp}"
                assert_close(loss, ref_loss, f"{what} loss")
                assert grads.keys() == ref_grads.keys()
                for name in ref_grads:
                    assert_close(grads[name], ref_grads[name], f"{what} grad {name}")
    return True


def test_tensor_parallel_matches_single_process():
    assert run_distributed(4, check_tensor_parallel, timeout=240) == [True] * 4


def test_model_config_errors_name_the_flag():
    from megapipe.errors import ConfigError

    with pytest.raises(ConfigError, match="--hidden-size 50 is not divisible by --num-attention-heads 4"):
        ModelConfig(hidden_size=50, num_attention_heads=4).validate()
    with pytest.raises(ConfigError, match="--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"):
        ModelConfig(hidden_size=48, num_attention_heads=6).validate(tensor_parallel=4)
    with pytest.raises(ConfigError, match="--hidden-size 36 is not divisible by --tensor-model-parallel-size 8"):
        ModelConfig(hidden_size=36, num_attention_heads=4, ffn_hidden_size=64).validate(tensor_parallel=8)
    with pytest.raises(ConfigError, match="--num-layers 10 is not divisible by --pipeline-model-parallel-size 4"):
        ModelConfig(num_layers=10).validate(pipeline_parallel=4)


@pytest.mark.parametrize("vocab,t,expected", [(50257, 1, 50304), (50257, 2, 50432), (256, 2, 256), (1, 8, 1024)])
def test_vocab_padding(vocab, t, expected):
    # Megatron's rule: the next multiple of make_vocab_size_divisible_by (128) x t
    assert ModelConfig(vocab_size=vocab).padded_vocab_size(t) == expected
