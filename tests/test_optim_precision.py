"""Single-process optimizer checks: gradient buffers, weight-decay groups, fp32/bf16/fp16 steps, resume."""

import copy
import math

import pytest
import torch

from megapipe.optim import (DynamicLossScaler, GradBuffers, LRScheduler, OptimizerConfig, build_optimizer,
                            finalize_model_grads)
from megapipe.optim.grad_sync import bucket_boundaries
from megapipe.parallel.state import ParallelState

pytestmark = pytest.mark.unit

PS = ParallelState.single()


def mlp(dtype=torch.float32, seed=0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 3)).to(dtype)


def batches(n, dtype=torch.float32, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=generator).to(dtype), torch.randn(5, 3, generator=generator).to(dtype))
            for _ in range(n)]


def microbatch_loss(model, x, y, microbatches):
    return torch.nn.functional.mse_loss(model(x).float(), y.float()) / microbatches


def optimizer_config(**fields) -> OptimizerConfig:
    cfg = OptimizerConfig(**{"lr": 1e-2, "lr_warmup_iters": 2, "lr_decay_iters": 10, "clip_grad": 0.0,
                             "weight_decay": 0.1, **fields})
    cfg.validate()
    return cfg


def reference_groups(params, weight_decay):
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def run_steps(model, opt, sched, grads, data, microbatches=2, inject=None):
    """Train on ``data`` in batches of ``microbatches``; ``inject(step, grads)`` may edit main grads."""
    results = []
    for step in range(len(data) // microbatches):
        for x, y in data[step * microbatches:(step + 1) * microbatches]:
            opt.scale_loss(microbatch_loss(model, x, y, microbatches)).backward()
        finalize_model_grads([model], PS, grads)
        if inject:
            inject(step, grads)
        results.append(opt.step())
        sched.step()
        opt.zero_grad()
    return results


# ---- gradient buffers --------------------------------------------------------------------
def test_bucket_boundaries_never_split_a_tensor():
    assert bucket_boundaries([3, 5, 2, 7], 6) == [(0, 8), (8, 17)]
    assert bucket_boundaries([3, 5, 2], 100) == [(0, 10)]
    assert bucket_boundaries([4, 4, 1], 4) == [(0, 4), (4, 8), (8, 9)]
    assert bucket_boundaries([], 4) == [(0, 0)]


def test_main_grads_are_views_of_one_buffer_in_buckets():
    model = mlp()
    grads = GradBuffers([model, model], PS, bucket_size=20)  # the same chunk twice counts once
    params = list(model.parameters())
    assert grads.params == params
    assert grads.buffer.numel() == sum(p.numel() for p in params)
    assert torch.cat([b for b in grads.buckets]).numel() == grads.buffer.numel()
    storage = grads.buffer.untyped_storage().data_ptr()
    for param in params:
        assert param.main_grad.untyped_storage().data_ptr() == storage and param.main_grad.shape == param.shape
    # reverse registration order: the last layer's bias opens the buffer
    assert params[-1].main_grad.data_ptr() == grads.buffer.data_ptr()


def test_hook_accumulates_bf16_grads_in_fp32_and_frees_them():
    model = mlp(torch.bfloat16)
    grads = GradBuffers([model], PS)
    (x1, y1), (x2, y2) = batches(2, torch.bfloat16)
    microbatch_loss(model, x1, y1, 2).backward()
    first = [p.main_grad.clone() for p in model.parameters()]
    assert all(p.grad is None for p in model.parameters())
    second = torch.autograd.grad(microbatch_loss(model, x2, y2, 2), list(model.parameters()))
    microbatch_loss(model, x2, y2, 2).backward()
    for param, g1, g2 in zip(model.parameters(), first, second):
        assert param.main_grad.dtype == torch.float32 and g2.dtype == torch.bfloat16
        assert torch.equal(param.main_grad, g1 + g2.float())  # the same two fp32 additions
    grads.zero()
    assert not grads.buffer.any()


def test_optimizer_refuses_buffers_of_other_chunks():
    with pytest.raises(ValueError, match="other model chunks"):
        build_optimizer([mlp()], optimizer_config(), PS, GradBuffers([mlp()], PS))


# ---- weight-decay groups -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_decay_group_holds_exactly_the_1d_params(dtype):
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 2, bias=False)).to(dtype)
    grads = GradBuffers([model], PS)
    opt = build_optimizer([model], optimizer_config(), PS, grads)
    decay, no_decay = opt.param_groups
    model_params = list(model.parameters())
    by_main = dict(zip(map(id, opt.main_params), model_params))
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [by_main[id(p)] for p in no_decay["params"]] == [p for p in model_params if p.ndim == 1]
    assert [by_main[id(p)] for p in decay["params"]] == [p for p in model_params if p.ndim != 1]
    assert len(no_decay["params"]) == 3  # linear bias, norm weight, norm bias


# ---- fp32: a thin layer over torch -------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_fp32_matches_plain_torch_bit_for_bit(optimizer):
    cfg = optimizer_config(optimizer=optimizer)
    model, reference = mlp(), mlp()
    grads = GradBuffers([model], PS)
    opt = build_optimizer([model], cfg, PS, grads)
    sched = LRScheduler(opt, cfg, train_iters=10)
    assert opt.inner.defaults["fused"] is True  # torch has a fused CPU kernel; the reference uses it too
    kwargs = dict(lr=cfg.lr, fused=True)
    if optimizer == "sgd":
        torch_opt = torch.optim.SGD(reference_groups(list(reference.parameters()), 0.1), momentum=0.9, **kwargs)
    else:
        torch_opt = torch.optim.AdamW(reference_groups(list(reference.parameters()), 0.1), **kwargs)
    data = batches(10)
    for step in range(5):
        for group in torch_opt.param_groups:
            group["lr"] = sched.lr
        for x, y in data[2 * step:2 * step + 2]:
            microbatch_loss(reference, x, y, 2).backward()
        expected_norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in reference.parameters()]))
        torch_opt.step()
        torch_opt.zero_grad()
        result, = run_steps(model, opt, sched, grads, data[2 * step:2 * step + 2])
        assert result.ok and result.grad_norm == pytest.approx(expected_norm.item(), rel=1e-6)
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(ours, theirs), (optimizer, step)


def test_clipping_scales_every_grad_by_megatron_coefficient():
    cfg = optimizer_config(optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, lr=1.0, lr_warmup_iters=0,
                           lr_decay_style="constant", clip_grad=0.05)
    model = mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            p += torch.linspace(-1, 1, p.numel()).view_as(p)  # nonzero activations, known weights
    before = [p.detach().clone() for p in model.parameters()]
    grads = GradBuffers([model], PS)
    opt = build_optimizer([model], cfg, PS, grads)
    x, y = batches(1)[0]
    microbatch_loss(model, x, y, 1).backward()
    full = [p.main_grad.double().clone() for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in full])).item()
    assert norm > 0.05
    result = opt.step()
    coefficient = 0.05 / (norm + 1e-6)
    assert result.grad_norm == pytest.approx(norm, rel=1e-6)
    for p, p0, g in zip(model.parameters(), before, full):
        # The fp32 main grads were clipped in place: one fp32 multiply each, 1e-6 relative vs float64.
        torch.testing.assert_close(p.main_grad.double(), g * coefficient, rtol=1e-6, atol=0.0)
        # p = p0 - lr * grad rounds to p's spacing: |p| <= 1 gives at most 2**-23 absolute error.
        torch.testing.assert_close((p0 - p).double(), g * coefficient, rtol=1e-6, atol=2.0 ** -23)


# ---- bf16 with fp32 masters --------------------------------------------------------------
def test_bf16_masters_follow_fp32_reference_fed_the_same_grads():
    cfg = optimizer_config(bf16=True)
    model = mlp(torch.bfloat16)
    reference = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    grads = GradBuffers([model], PS)
    opt = build_optimizer([model], cfg, PS, grads)
    sched = LRScheduler(opt, cfg, train_iters=10)
    torch_opt = torch.optim.AdamW(reference_groups(reference, 0.1), lr=cfg.lr, fused=True)

    def feed_reference(step, grads_):
        for ref, param in zip(reference, model.parameters()):
            ref.grad = param.main_grad.clone()
        for group in torch_opt.param_groups:
            group["lr"] = sched.lr
        torch_opt.step()

    results = run_steps(model, opt, sched, grads, batches(12, torch.bfloat16), inject=feed_reference)
    assert all(r.ok for r in results) and len(results) == 6
    masters = opt.main_params
    for master, ref, param in zip(masters, reference, model.parameters()):
        # Same fp32 inputs (start values, grads, lr) through the same fused kernel: exact equality.
        assert master.dtype == torch.float32 and torch.equal(master, ref)
        assert param.dtype == torch.bfloat16 and torch.equal(param, master.to(torch.bfloat16))
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)  # masters hold more bits


def test_nan_grad_without_loss_scaling_skips_the_step():
    cfg = optimizer_config(bf16=True)
    model = mlp(torch.bfloat16)
    grads = GradBuffers([model], PS)
    opt = build_optimizer([model], cfg, PS, grads)
    before = [p.detach().clone() for p in model.parameters()]

    def poison(step, grads_):
        next(model.parameters()).main_grad[0, 0] = float("nan")

    result, = run_steps(model, opt, LRScheduler(opt, cfg, 10), grads, batches(2, torch.bfloat16), inject=poison)
    assert not result.ok and math.isnan(result.grad_norm)  # reported, so the log counts a nan iteration
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ---- fp16 loss scaling -------------------------------------------------------------------
def tiny_fp16_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).half()


def test_fp16_dynamic_scaling_skips_overflow_backs_off_and_grows():
    cfg = optimizer_config(fp16=True, initial_loss_scale=1024.0, loss_scale_window=3, hysteresis=2)
    model = tiny_fp16_model()
    grads = GradBuffers([model], PS)
    opt = build_optimizer([model], cfg, PS, grads)
    sched = LRScheduler(opt, cfg, train_iters=10)
    reference = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    torch_opt = torch.optim.AdamW(reference_groups(reference, 0.1), lr=cfg.lr, fused=True)
    overflow_steps = {1, 2}
    history = []

    def inject(step, grads_):
        if step in overflow_steps:
            next(model.parameters()).main_grad[1, 2] = float("inf")
            return
        for ref, param in zip(reference, model.parameters()):
            ref.grad = param.main_grad / opt.loss_scale  # exact: the scale is a power of two
        for group in torch_opt.param_groups:
            group["lr"] = sched.lr
        torch_opt.step()

    def record(step, grads_):
        history.append(([p.detach().clone() for p in model.parameters()], opt.loss_scale))
        inject(step, grads_)

    data = batches(14, torch.float16)
    results = run_steps(model, opt, sched, grads, data, inject=record)
    scales_before = [scale for _, scale in history]
    # step 0 clean; 1: overflow uses up hysteresis; 2: overflow halves; 3-5 clean; the third doubles.
    assert [r.ok for r in results] == [True, False, False, True, True, True, True]
    assert scales_before == [1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]
    assert results[1].grad_norm is None
    for step in overflow_steps:  # a skipped step leaves the params exactly as they were
        assert all(torch.equal(a, b) for a, b in zip(history[step][0], history[step + 1][0]))
    assert opt.inner.state[opt.main_params[0]]["step"].item() == 5  # the inner optimizer never saw the skips
    for master, ref, param in zip(opt.main_params, reference, model.parameters()):
        assert torch.equal(master, ref)  # unscaled grads are exact, so masters match fp32 AdamW exactly
        assert torch.equal(param, master.half())


def test_fp16_constant_scale_skips_without_moving():
    cfg = optimizer_config(fp16=True, loss_scale=256.0)
    model = tiny_fp16_model()
    grads = GradBuffers([model], PS)
    opt = build_optimizer([model], cfg, PS, grads)

    def poison(step, grads_):
        if step == 0:
            next(model.parameters()).main_grad[0, 0] = float("-inf")

    results = run_steps(model, opt, LRScheduler(opt, cfg, 10), grads, batches(4, torch.float16), inject=poison)
    assert [r.ok for r in results] == [False, True] and opt.loss_scale == 256.0


def test_fp16_sgd_with_momentum_whose_first_step_overflows_then_steps_as_if_first():
    """A skipped first step leaves SGD's momentum as it found it (torch's fused kernel would leave it
    uninitialized): the next update equals a fresh optimizer's first, on the same gradients."""
    cfg = optimizer_config(fp16=True, optimizer="sgd", sgd_momentum=0.9, weight_decay=0.0, lr_warmup_iters=0,
                           lr_decay_style="constant", initial_loss_scale=1024.0, hysteresis=1)
    data = batches(4, torch.float16)
    updated = []
    for skip_first in (True, False):
        model = tiny_fp16_model()
        grads = GradBuffers([model], PS)
        opt = build_optimizer([model], cfg, PS, grads)

        def poison(step, grads_):
            if skip_first and step == 0:
                next(model.parameters()).main_grad[0, 0] = float("inf")

        results = run_steps(model, opt, LRScheduler(opt, cfg, 10), grads, data if skip_first else data[2:],
                            inject=poison)
        assert [r.ok for r in results] == ([False, True] if skip_first else [True])
        updated.append([main.detach().clone() for main in opt.main_params])
    for after_skip, first in zip(*updated):
        torch.testing.assert_close(after_skip, first, rtol=0, atol=0)


def test_dynamic_scaler_floor_and_hysteresis_reset_only_on_growth():
    scaler = DynamicLossScaler(initial_scale=4.0, min_scale=1.0, window=2, hysteresis=2)
    trace = []
    for overflow in (True, False, True, True, True, True, False, False, True):
        scaler.update(overflow)
        trace.append(scaler.scale)
    # a clean step between overflows does not restore hysteresis (Megatron); growth does.
    assert trace == [4.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0]


# ---- checkpoint resume -------------------------------------------------------------------
def test_state_dict_resumes_exactly():
    cfg = optimizer_config(fp16=True, initial_loss_scale=1024.0, loss_scale_window=2)
    data = batches(8, torch.float16)

    def setup(model):
        grads = GradBuffers([model], PS)
        opt = build_optimizer([model], cfg, PS, grads)
        return opt, LRScheduler(opt, cfg, train_iters=10), grads

    model = tiny_fp16_model()
    opt, sched, grads = setup(model)
    run_steps(model, opt, sched, grads, data[:4])
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    run_steps(model, opt, sched, grads, data[4:])

    resumed = tiny_fp16_model()
    with torch.no_grad():
        for p in resumed.parameters():
            p.fill_(7.0)  # load_state_dict must restore params from the masters, not keep these
    opt2, sched2, grads2 = setup(resumed)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    assert opt2.loss_scale == saved["opt"]["loss_scaler"]["scale"] == 2048.0
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), saved["model"].values()))
    run_steps(resumed, opt2, sched2, grads2, data[4:])
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(opt2.main_params, opt.main_params))
    assert opt2.loss_scale == opt.loss_scale and sched2.lr == sched.lr


def test_a_trained_model_is_freed_once_its_last_user_lets_go():
    """Gradient syncs hook every parameter; the hooks must not keep the model (on a GPU: weights,
    main gradients and optimizer state) alive once nothing else refers to it."""
    import gc
    import weakref

    ps = ParallelState.single()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    grads = GradBuffers([model], ps)
    optimizer = build_optimizer([model], OptimizerConfig(lr=0.1), ps, grads)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    alive = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(grads.buffer)]
    del model, grads, optimizer
    gc.collect()
    assert [ref() for ref in alive] == [None] * len(alive)
