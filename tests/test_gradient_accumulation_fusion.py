"""Gradient-accumulation fusion: the linears' weight-gradient products go straight into the main gradients.

References: the same run with ``gradient_accumulation_fusion=False``, where autograd hands each weight its
gradient and the gradient sync's hook adds it (the path the fusion replaces), and, for the arithmetic of a
bf16 product, its float64 value from the same bf16 operands.

* fp32: every step's main gradients, after several microbatches, equal the unfused run's bit for bit: under
  1F1B and under zero-bubble's split backward (BW adds the products), at every ZeRO level (d = 1), with full
  recomputation and with the MoE experts' grouped product and loop. The fused products are computed in the
  weight's dtype and added, which is the unfused path's arithmetic, so equality is exact.
* Readiness: with ``--overlap-grad-reduce`` every bucket's reduction starts during the final backward, as
  the hook counts a fused weight once after its last use (the tied word embedding at p = 1 is used twice).
* Stashed weights (PipeDream): a forward on aliases whose backward comes after an update gives the live
  parameters' main gradients those of the forward's version, bit for bit.
* bf16 on a CPU (no fp32-output product): each microbatch's product is rounded once to bf16 and added in
  fp32, so the main gradient is within 2^-8 (bf16's unit roundoff) of the summed magnitudes of the float64
  products, plus fp32 roundoff.
* On the fake accelerator (meta), which has the fp32-output product as CUDA does, no bf16 tensor of a weight's
  shape is made by the backward, where the unfused path makes one per linear weight.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from batch_helpers import random_microbatch
from fake_device_helpers import S, model_config as fake_model_config
from megapipe.config import ModelConfig
from megapipe.cli.parse import config_from_argv
from megapipe.models import build_model_chunks
from megapipe.optim import GradBuffers, OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.schedules.weight_policy import WeightPolicy
from megapipe.pipeline.engine import PipelineEngine
from megapipe.pipeline.weights import WeightVersionStore
from megapipe.tensor_parallel.grad_accumulation import accumulates_wider, main_grad_target
from megapipe.tensor_parallel.split_backward import apply_weight_gradients, deferring_weight_gradients, linear
from megapipe.testing.fake_device import FAKE_DEVICE, fake_accelerator
from test_moe_layer import moe_config
from test_pipeline_training import MICRO, SEQ, model_config

pytestmark = pytest.mark.unit

M, STEPS = 3, 2


def engine_main_grads(config: ModelConfig, schedule: str, sharding: str, fuse: bool) -> list[list[torch.Tensor]]:
    """The main gradients each optimizer step of a p = d = 1 engine reads (``STEPS`` steps of ``M`` microbatches)."""
    torch.manual_seed(0)
    ps = ParallelState.single()
    chunks = build_model_chunks("gpt", config, ps)
    optimizer = OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.9, weight_decay=0.0, clip_grad=1.0,
                                data_parallel_sharding_strategy=sharding)
    engine = PipelineEngine(chunks, ps, optimizer, schedule, M, (config.seq_length, MICRO, config.hidden_size),
                            gradient_accumulation_fusion=fuse)
    targets = [main_grad_target(p) is not None for chunk in chunks for p in chunk.parameters() if p.ndim > 1]
    assert any(targets) == fuse
    opt, seen = engine.optimizers[0], []
    step = opt.step

    def recording_step(*args, **kwargs):
        seen.append([grad.clone() for grad in opt.main_grads])
        return step(*args, **kwargs)

    opt.step = recording_step
    for index in range(STEPS):
        engine.train_batch([random_microbatch("gpt", config.vocab_size, MICRO, config.seq_length, seed=10 * index + i)
                            for i in range(M)])
    assert len(seen) == STEPS
    return seen


FP32_CASES = {
    "1f1b": ("1f1b", "no_shard", {}),
    "zb-h1": ("zb-h1", "no_shard", {}),
    "zb-h1-recompute": ("zb-h1", "no_shard", dict(recompute=True)),
    "1f1b-optim": ("1f1b", "optim", {}),
    "zb-h1-optim-grads": ("zb-h1", "optim_grads", {}),
    "1f1b-optim-grads-params": ("1f1b", "optim_grads_params", {}),
    "zb-h1-moe-loop": ("zb-h1", "no_shard", dict(moe=False)),
    "1f1b-moe-grouped": ("1f1b", "no_shard", dict(moe=True)),
}


@pytest.mark.parametrize("case", sorted(FP32_CASES))
def test_fp32_main_grads_are_those_of_the_unfused_path_bit_for_bit(case):
    schedule, sharding, options = FP32_CASES[case]
    if "moe" in options:
        config = moe_config(moe_grouped_gemm=options["moe"], moe_aux_loss_coeff=0.01)
    else:
        config = model_config("gpt", options.get("recompute", False), num_layers=2)
    fused = engine_main_grads(config, schedule, sharding, fuse=True)
    unfused = engine_main_grads(config, schedule, sharding, fuse=False)
    for step, (ours, theirs) in enumerate(zip(fused, unfused)):
        assert len(ours) == len(theirs)
        for index, (a, b) in enumerate(zip(ours, theirs)):
            assert torch.equal(a, b), (case, step, index)


def backward(model, batch, split: bool) -> None:
    loss = model(None, batch)
    if not split:
        loss.backward()
        return
    deferred = []
    with deferring_weight_gradients(deferred):
        loss.backward()
    apply_weight_gradients(deferred)


def autograd_weight_gradients(model) -> set[str]:
    """Names of the parameters autograd hands a gradient to during backward (recorded by a hook run
    before the gradient sync's, which takes the gradient)."""
    given = set()

    def record(param, name):
        if param.grad is not None:
            given.add(name)

    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: record(p, name))
    return given


@pytest.mark.parametrize("split", [False, True])
def test_overlapped_buckets_start_in_the_final_backward_and_linears_get_no_autograd_gradient(split):
    """Small buckets, the final of two microbatches overlapped: every bucket starts during it, no
    gradient arrives after its bucket started, and the main gradients are the unfused ones. Untied
    under the split: at p = 1 the tied embedding gets its lookup's part in BI and the output layer's in BW,
    two arrivals, with or without the fusion."""
    config = dataclasses.replace(model_config("gpt", num_layers=2), untie_embeddings_and_output_weights=split)
    batches = [random_microbatch("gpt", config.vocab_size, MICRO, SEQ, seed=i) for i in range(2)]
    main_grads = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        model = build_model_chunks("gpt", config, ParallelState.single())[0]
        given = autograd_weight_gradients(model)
        grads = GradBuffers([model], ParallelState.single(), bucket_size=2000, overlap_grad_reduce=True,
                            gradient_accumulation_fusion=fuse)
        sync, = grads.syncs
        assert len(sync.buckets) > 3
        sync.reductions = []
        for index, batch in enumerate(batches):
            sync.begin_backward(final=index == len(batches) - 1)
            backward(model, batch, split)
        assert sorted(record.bucket for record in sync.reductions) == [b.index for b in sync.buckets if not b.late]
        main_grads[fuse] = {name: p.main_grad.clone() for name, p in model.named_parameters()}
        linears = {name for name, p in model.named_parameters() if p.ndim == 2 and "embeddings" not in name}
        assert linears and (given & linears == set() if fuse else linears <= given)
    for name, grad in main_grads[True].items():
        assert torch.equal(grad, main_grads[False][name]), name


def main_grads_on_stashed_weights(fuse: bool, stash: bool) -> dict[str, torch.Tensor]:
    """One microbatch's main gradients; with ``stash`` its forward ran on aliases of the weights (PipeDream's
    weight stashing) and an update moved the live weights before its backward."""
    torch.manual_seed(0)
    config = model_config("gpt", num_layers=2)
    model = build_model_chunks("gpt", config, ParallelState.single())[0]
    GradBuffers([model], ParallelState.single(), gradient_accumulation_fusion=fuse)
    batch = random_microbatch("gpt", config.vocab_size, MICRO, SEQ, seed=5)
    if not stash:
        model(None, batch).backward()
        return {name: p.main_grad.clone() for name, p in model.named_parameters()}
    store = WeightVersionStore(model, WeightPolicy.STASH)
    use = store.forward(0, survives_update=True)
    loss = functional_call(model, use.weights, (None, batch))

    def update():
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.5)

    store.update(update, next_forward_version=1)
    loss.backward()
    store.backward_done(use)
    assert all(alias.grad is None for alias in use.weights.values())
    return {name: p.main_grad.clone() for name, p in model.named_parameters()}


def test_stashed_weights_products_go_into_the_live_parameters_main_grads():
    expected = main_grads_on_stashed_weights(fuse=False, stash=False)
    for fuse in (True, False):
        actual = main_grads_on_stashed_weights(fuse, stash=True)
        for name, grad in expected.items():
            assert torch.equal(actual[name], grad), (fuse, name)


def test_bf16_products_accumulate_within_one_bf16_rounding_of_their_exact_sum():
    """One bf16 linear, three microbatches with known output gradients: main_grad against the float64 sum
    of the products of the same bf16 operands. On a CPU each product is rounded once to bf16 (relative
    error at most 2^-8) and added in fp32 (at most 2^-24 relative per addition, three additions)."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(24, 40, dtype=torch.bfloat16))
    GradBuffers([module], ParallelState.single())
    given = autograd_weight_gradients(module)
    exact, magnitude = torch.zeros(24, 40, dtype=torch.float64), torch.zeros(24, 40, dtype=torch.float64)
    for _ in range(3):
        x = torch.randn(64, 40, dtype=torch.bfloat16)
        grad_output = torch.randn(64, 24, dtype=torch.bfloat16)
        (linear(x, module.weight) * grad_output).sum().backward()
        product = grad_output.double().t() @ x.double()
        exact += product
        magnitude += product.abs()
    assert not given
    bound = (2.0 ** -8 + 4 * 2.0 ** -24) * magnitude + 1e-30
    error = (module.weight.main_grad.double() - exact).abs()
    assert (error <= bound).all() and error.max() > 0  # rounded to bf16 on a CPU, as the unfused path does


PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
            torch.ops.aten._grouped_mm}


class WeightShapedProducts(TorchDispatchMode):
    """Counts the matrix products that return a tensor of ``dtype`` in one of ``shapes`` (the embedding's
    lookup gradient, of the output layer's shape, is no product)."""

    def __init__(self, shapes: set, dtype: torch.dtype):
        super().__init__()
        self.shapes, self.dtype, self.count = shapes, dtype, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in PRODUCTS and out.dtype == self.dtype and tuple(out.shape) in self.shapes:
            self.count += 1
        return out


@pytest.mark.parametrize("fuse", [True, False])
def test_no_bf16_weight_gradient_is_made_where_products_write_fp32(fuse):
    ps = ParallelState.single()
    with fake_accelerator():
        config = fake_model_config("gpt", "bf16", untie_embeddings_and_output_weights=True)
        ps.seed(1234, FAKE_DEVICE)
        model = build_model_chunks("gpt", config, ps, device=FAKE_DEVICE)[0]
        if fuse and not accumulates_wider(FAKE_DEVICE, torch.bfloat16, torch.float32):
            pytest.skip("this torch's fake tensors cannot run addmm with out_dtype (torch 2.11 decomposes it wrongly)")
        GradBuffers([model], ps, gradient_accumulation_fusion=fuse)
        linears = [p for name, p in model.named_parameters() if p.ndim == 2 and "embeddings" not in name]
        shapes = {tuple(p.shape) for p in linears}
        tokens = torch.randint(0, config.vocab_size, (3, S), device=FAKE_DEVICE)  # 48 rows: no weight's shape
        loss = model(None, {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(3, S, device=FAKE_DEVICE)})
        with WeightShapedProducts(shapes, torch.bfloat16) as counted:
            loss.backward()
    assert counted.count == (0 if fuse else len(linears)), (len(linears), shapes)


def test_the_flag_turns_the_fusion_off():
    assert config_from_argv("gpt", []).model.gradient_accumulation_fusion
    assert not config_from_argv("gpt", ["--no-gradient-accumulation-fusion"]).model.gradient_accumulation_fusion
