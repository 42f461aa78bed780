"""A split backward (BI, then BW) gives exactly the gradients of one backward.

Reference: the same model's plain backward from the same weights and data, in one process.
BI runs the backward with the linears' weight-gradient products deferred; BW computes them.
The sum is the same maths in the same order per product, so the gradients must be equal to
fp32 rounding of one matrix product (1e-6 relative), with and without full recomputation, for
GPT and BERT (both tie the output layer to the word embedding, whose product is deferred too). The
post-accumulate hooks (which the data-parallel gradient syncs use) see every weight's
gradient once: BI's for the non-deferred ones, BW's for the linears' weights, and the tied
word embedding (GPT's and BERT's) twice (its lookup's part in BI, the output layer's in BW).
"""

import pytest
import torch

from batch_helpers import random_microbatch
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.split_backward import apply_weight_gradients, deferring_weight_gradients
from test_pipeline_training import MICRO, SEQ, model_config


def gradients(kind: str, recompute: bool, split: bool):
    torch.manual_seed(0)
    config = model_config(kind, recompute)
    model = build_model_chunks(kind, config, ParallelState.single())[0]
    seen = {}
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.setdefault(name, []).append(p.grad is not None))
    loss = model(None, random_microbatch(kind, config.vocab_size, MICRO, SEQ, seed=7))
    if split:
        deferred = []
        with deferring_weight_gradients(deferred):
            loss.backward()
        assert deferred
        apply_weight_gradients(deferred)
    else:
        loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, seen


@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("recompute", [False, True])
def test_bi_then_bw_equals_one_backward(kind, recompute):
    expected, _ = gradients(kind, recompute, split=False)
    actual, seen = gradients(kind, recompute, split=True)
    assert actual.keys() == expected.keys()
    for name in expected:
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-6, atol=1e-6 * scale, msg=name)
    for name, calls in seen.items():  # one gradient per weight; the tied embedding's lookup (BI) and output layer (BW)
        assert sum(calls) == (2 if name.endswith("word_embeddings.weight") else 1), (name, calls)
