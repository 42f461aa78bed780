"""GPU acceptance (``-m cuda``, run by tools/gpu_check.sh): fused and Triton kernels against eager in
fp32 and bf16, recomputation, one-GPU training through pretrain_gpt.py with each fusion backend, a
checkpoint saved and resumed on the GPU, and training iterations that never wait for the GPU.
Skipped where no CUDA device exists."""

import os
import re
import subprocess
import sys

import pytest
import torch

from fusion_helpers import grads
from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.distributed import default_device
from megapipe.fusions import backend
from megapipe.models import build_model_chunks
from megapipe.parallel_state import ParallelState
from test_iteration_syncs import CASES, ONE_PROCESS_ONLY
from test_training_cli import ROOT, TINY, losses, run

DEVICE = default_device()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")]
FAMILIES = ("triton", "compile", "apex")
LOSS_TEXT = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)")
# Kernels sum in another order than eager PyTorch: fp32 results differ by the rounding of reductions
# over up to 512 elements (~sqrt(512) ULP, 3e-6 of the largest term); 1e-5 relative to each element
# plus 1e-5 of the tensor's largest magnitude (for sums that cancel to near zero, such as bias
# gradients) bounds that with margin. In bf16 the kernel and eager PyTorch each give the exact value
# after at most two roundings to bf16 (2 x 2^-8 relative), so they differ by at most 2^-6, plus the
# same cancellation allowance at bf16's precision.
FP32 = dict(rtol=1e-5, scale=1e-5)
BF16 = dict(rtol=2 ** -6, scale=2 ** -6)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, scale: float, msg: str) -> None:
    torch.testing.assert_close(actual.float(), expected, rtol=rtol, atol=scale * expected.abs().max().item(),
                               msg=msg)


@pytest.fixture(params=FAMILIES)
def family(request):
    chosen = fusions.select_backend(request.param, DEVICE)
    if chosen.name != request.param:
        pytest.skip(chosen.reason)
    yield request.param
    backend.activate(backend.FusionBackend("eager", "test"))


def _ops(dtype):
    """(name, inputs, f(fused, *inputs)) of every fused op, on the GPU in ``dtype``."""
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=DEVICE, dtype=dtype).requires_grad_()

    x, residual, bias = randn(128, 4, 256), randn(128, 4, 256), randn(256)
    scores = randn(4, 8, 128, 128)
    padding = torch.zeros(4, 1, 1, 128, dtype=torch.bool, device=DEVICE)
    padding[1, ..., 100:] = True
    weight = randn(256)
    return [
        ("bias_gelu", (x, bias), lambda fused, x, b: fusions.bias_gelu(x, b, approximate="tanh", fused=fused)),
        ("bias_dropout_add", (x, bias, residual),
         lambda fused, x, b, r: fusions.bias_dropout_add(x, b, r, 0.0, True, fused=fused)),
        ("scale_mask_softmax", (scores,),
         lambda fused, s: fusions.scale_mask_softmax(s, 0.125, padding, causal=True, fused=fused)),
        ("layer_norm", (x, weight, bias), lambda fused, x, w, b: fusions.layer_norm(x, w, b, 1e-5)),
        ("rms_norm", (x, weight), lambda fused, x, w: fusions.rms_norm(x, w, 1e-5)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_kernels_equal_eager(family, dtype):
    """Outputs and input gradients of each family's kernels against eager PyTorch in the same dtype."""
    for name, inputs, op in _ops(dtype):
        out = op(True, *inputs)
        grad_out = torch.randn_like(out)
        got = (out, *grads(out, grad_out, *inputs))
        previous = backend.activate(backend.FusionBackend("eager", "reference"))
        reference_inputs = [t.detach().clone().requires_grad_() for t in inputs]
        reference = op(False, *reference_inputs)
        want = tuple(t.float() for t in (reference, *grads(reference, grad_out, *reference_inputs)))
        backend.activate(previous)
        for a, b in zip(got, want):
            assert a.dtype == dtype, name
            assert_close(a, b, **(FP32 if dtype == torch.float32 else BF16), msg=name)


def test_recomputation_gives_the_gradients_without_it():
    """Full and selective recomputation replay the forward's dropout masks on the GPU."""
    def gradients(**recompute):
        ps = ParallelState.single()
        ps.seed(5, DEVICE)
        config = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512,
                             hidden_dropout=0.1, attention_dropout=0.1, **recompute)
        model = build_model_chunks("gpt", config, ps, seed=5, device=DEVICE)[0].train()
        g = torch.Generator(device=DEVICE).manual_seed(1)
        tokens = torch.randint(0, 512, (2, 64), generator=g, device=DEVICE)
        loss = model(None, {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones_like(
            tokens, dtype=torch.float32)})
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    plain = gradients()
    for recompute in (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                      dict(recompute_granularity="selective")):
        for a, b in zip(gradients(**recompute), plain):
            assert_close(a, b, **FP32, msg=str(recompute))  # same kernels; atomics in some backwards reorder sums


@pytest.mark.parametrize("fusion_backend", ["eager", "triton", "compile", "apex"])
def test_one_gpu_training_with_each_fusion_backend(fusion_backend, tmp_path):
    result = run(TINY + ["--bf16", "--fusion-backend", fusion_backend, "--train-iters", "8"], cache=tmp_path)
    assert result.returncode == 0, result.stderr
    chosen = re.search(r"fusion backend (\w+) \(([^)]*)\)", result.stdout)
    if chosen[1] != fusion_backend:
        pytest.skip(chosen[2])
    values = losses(result.stdout)
    assert sorted(values) == list(range(1, 9)) and values[8] < values[1]


def test_checkpoint_saved_and_resumed_on_the_gpu(tmp_path):
    """Resumed from iteration 2, iterations 3-4 repeat the uninterrupted run (fp32, no dropout)."""
    ckpt = str(tmp_path / "ckpt")
    common = TINY + ["--train-iters", "4", "--lr-decay-iters", "4"]
    whole = run(common, cache=tmp_path)
    first = run(common + ["--save", ckpt, "--exit-interval", "2"], cache=tmp_path)
    resumed = run(common + ["--load", ckpt], cache=tmp_path)
    for result in (whole, first, resumed):
        assert result.returncode == 0, result.stderr
    expected, got = losses(whole.stdout), losses(resumed.stdout)
    assert sorted(got) == [3, 4]
    for i in got:
        assert got[i] == pytest.approx(expected[i], rel=1e-5)


# In a process of its own (a process group in pytest's would leak into later tests): one line per case
COUNT_SYNCHRONISATIONS = ("import sys; sys.path.insert(0, 'tests'); import test_iteration_syncs as t\n"
                          "for schedule, m, extra in t.CASES + t.ONE_PROCESS_ONLY:\n"
                          "    print('synchronisations', schedule, m, *extra, '=', t.syncs_of(1, schedule, m, extra),"
                          " flush=True)")


def test_training_iterations_never_wait_for_the_gpu():
    """``test_iteration_syncs``'s one-process cases (1F1B and 2BW at m = 2 and 8, fp16 and bf16) on
    the GPU, counted by CUDA's sync debug mode: no synchronisation outside log intervals."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    result = subprocess.run([sys.executable, "-c", COUNT_SYNCHRONISATIONS], capture_output=True, text=True,
                            cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = re.findall(r"^synchronisations (.*) = (\d+)$", result.stdout, re.MULTILINE)
    assert len(counts) == len(CASES + ONE_PROCESS_ONLY) and all(count == "0" for _, count in counts), result.stdout
