"""A split backward (BI, then BW) gives exactly the gradients of one backward.

Reference: the same model's plain backward from the same weights and data, in one process.
BI runs the backward with the linears' weight-gradient products deferred; BW computes them.
The sum is the same maths in the same order per product, so the gradients must be equal to
fp32 rounding of one matrix product (1e-6 relative), with and without full recomputation, for
GPT and BERT (both tie the output layer to the word embedding, whose product is deferred too). The
post-accumulate hooks (which the data-parallel gradient syncs use) see every weight's
gradient once: BI's for the non-deferred ones, BW's for the linears' weights, and the tied
word embedding (GPT's and BERT's) twice (its lookup's part in BI, the output layer's in BW).
An MoE layer's stacked expert weights wait for BW too, under the grouped product and the loop.
"""

import pytest
import torch

from batch_helpers import random_microbatch
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.split_backward import apply_weight_gradients, deferring_weight_gradients
from test_moe_layer import moe_config
from test_pipeline_training import MICRO, SEQ, model_config

pytestmark = pytest.mark.unit


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


@pytest.mark.parametrize("grouped", [True, False])
def test_the_experts_weight_gradients_wait_for_bw(grouped):
    """BI leaves every expert weight without a gradient (the router's and the shared expert's gate's are
    not deferred); BW gives them one backward's gradients, with the grouped product and the loop alike."""
    config = moe_config(moe_grouped_gemm=grouped, moe_aux_loss_coeff=0.1, num_layers=1)
    model = build_model_chunks("gpt", config, ParallelState.single())[0]
    batch = random_microbatch("gpt", config.vocab_size, MICRO, config.seq_length, seed=3)
    model(None, batch).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    deferred = []
    with deferring_weight_gradients(deferred):
        model(None, batch).backward()
    experts = {name for name in expected if ".experts." in name}
    assert experts == {"layers.0.mlp.experts.fc1.weight", "layers.0.mlp.experts.fc2.weight"}
    assert all(p.grad is None for name, p in model.named_parameters() if name in experts)
    assert model.layers["0"].mlp.router.weight.grad is not None
    apply_weight_gradients(deferred)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-6, atol=1e-6 * expected[name].abs().max().item(),
                                   msg=name)
