"""Activation recomputation: bit-for-bit the same training, and the memory seed 002 predicts."""

import datetime

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from megapipe.models import build_model_chunks
from megapipe.models.gpt import GPTStage
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed
from model_families import family_config

VARIANTS = [dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
            dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
            dict(recompute_granularity="selective")]
SEQ, MICRO = 16, 3


def config(kind, **overrides):
    common = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=120, seq_length=SEQ,
                  hidden_dropout=0.1, attention_dropout=0.1, make_vocab_size_divisible_by=8)
    return family_config(kind, **{**common, **overrides})


def batch(kind, cfg, index=0):
    g = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, cfg.vocab_size, (MICRO, SEQ), generator=g)
    out = {"tokens": tokens, "labels": torch.randint(0, cfg.vocab_size, (MICRO, SEQ), generator=g),
           "loss_mask": torch.ones(MICRO, SEQ)}
    if kind == "bert":
        out.update(types=torch.zeros_like(tokens), padding_mask=torch.ones_like(tokens),
                   is_random=torch.tensor([0, 1, 0]))
    return out


def loss_and_grads(kind, cfg, ps, sequence_parallel=False):
    ps.seed(5, torch.device("cpu"))
    model = build_model_chunks("bert" if kind == "bert" else "gpt", cfg, ps,
                               sequence_parallel=sequence_parallel)[0].train()
    losses = []
    for i in range(2):  # two microbatches: the random streams must continue identically
        loss = model(None, batch(kind, cfg, i))
        loss.backward()
        losses.append(loss.detach())
    return losses, [p.grad.clone() for p in model.parameters()]


def assert_identical(a, b):
    (losses_a, grads_a), (losses_b, grads_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(losses_a, losses_b))
    assert all(torch.equal(x, y) for x, y in zip(grads_a, grads_b))


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["gpt", "bert", "llama"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(str(x) for x in v.values()))
def test_recompute_is_bit_for_bit_with_dropout(kind, variant):
    reference = loss_and_grads(kind, config(kind), ParallelState.single())
    assert_identical(loss_and_grads(kind, config(kind, **variant), ParallelState.single()), reference)


def tensor_and_pipeline_parallel(rank, world_size):
    # t = 2: attention dropout draws from the per-tensor-rank stream, which recomputation must restore
    ps = ParallelState.initialize(tensor=2)
    reference = loss_and_grads("gpt", config("gpt"), ps)
    for variant in VARIANTS:
        assert_identical(loss_and_grads("gpt", config("gpt", **variant), ps), reference)
    # inside a pipeline schedule (1F1B, p = 2): same losses and weights after two steps
    results = []
    for recompute in ({}, VARIANTS[0]):
        ps = ParallelState.initialize(pipeline=2)
        ps.seed(5, torch.device("cpu"))
        cfg = config("gpt", **recompute)
        engine = PipelineEngine(build_model_chunks("gpt", cfg, ps), ps,
                                OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0, clip_grad=0.0),
                                "1f1b", 4, (SEQ, MICRO, cfg.hidden_size), timeout=datetime.timedelta(seconds=60))
        losses = [engine.train_batch([batch("gpt", cfg, 4 * s + i) for i in range(4)]).losses for s in range(2)]
        results.append((losses, [p.detach().clone() for p in engine.chunks[0].parameters()]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(x, y) for x, y in zip(results[0][1], results[1][1]))
    return True


@pytest.mark.distributed
def test_recompute_under_tensor_parallelism_and_inside_a_pipeline_schedule():
    assert run_distributed(2, tensor_and_pipeline_parallel, timeout=240) == [True, True]


class SavedBytes:
    """Bytes of distinct storages the autograd graph saves, split by pass (forward / backward)."""

    def __init__(self):
        self.seen = {"forward": {}, "backward": {}}
        self.phase = "forward"

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        self.seen[self.phase][storage.data_ptr()] = storage.nbytes()
        return tensor

    def total(self, phase):
        return sum(self.seen[phase].values())


def measure(cfg, layers):
    """Saved bytes of a middle pipeline stage (transformer layers only) for one microbatch."""
    ps = ParallelState.single()
    stage = GPTStage(cfg, ps, 0, layers, pre_process=False, post_process=False).train()
    hidden = torch.randn(SEQ, MICRO, cfg.hidden_size, requires_grad=True)
    bytes_ = SavedBytes()
    with saved_tensors_hooks(bytes_.pack, lambda t: t):
        out = stage(hidden, {})
        bytes_.phase = "backward"  # recomputed groups save their intermediates now
        out.sum().backward()
    return bytes_.total("forward"), bytes_.total("backward")


@pytest.mark.unit
def test_saved_activation_memory_follows_the_formula():
    """c A_input + (l / c) A_intermediate (seed 002 section 4.3.5) for l = 4 layers."""
    base = dict(hidden_dropout=0.0, attention_dropout=0.0)
    l = 4
    a_input = SEQ * MICRO * 32 * 4  # one [s, b, h] fp32 tensor
    a_layer, _ = measure(config("gpt", **base), 1)  # everything one layer keeps without recomputation
    no_recompute, _ = measure(config("gpt", **base), l)
    assert no_recompute == l * a_layer
    for group in (1, 2, 4):
        c = l // group
        cfg = config("gpt", recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=group, **base)
        forward, _ = measure(cfg, l)
        assert forward == c * a_input  # only the checkpoints' inputs stay
        # the backward rebuilds one group of l / c layers at a time: that group's intermediates are the
        # live peak (measured on a stage of one group: addresses of freed groups are reused, so bursts
        # of a longer stage cannot be told apart by storage)
        _, one_group = measure(cfg, group)
        assert one_group == (l // c) * a_layer
        if c > 1:  # one checkpoint for the whole stage saves nothing: the peak is then one full stage again
            assert c * a_input + (l // c) * a_layer < no_recompute
    # selective recomputation keeps less in every layer (tests/test_selective_recompute.py: how much) and
    # saves nothing more while its recipes run in the backward pass
    selective, during_backward = measure(config("gpt", recompute_granularity="selective", **base), l)
    assert selective < no_recompute and during_backward == 0
