"""Shared pieces of the fused-kernel tests: kernel-family fixture and precision-aware comparisons."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megapipe.fusions import backend

# torch.compile costs 10-45 s per function on this machine, so it is tested only on request.
COMPILE_TESTS = os.environ.get("MEGAPIPE_TEST_COMPILE") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _interpret_triton(monkeypatch) -> None:
    """Run Triton's kernels in its CPU interpreter for this test, or skip where that cannot be."""
    if not HAS_TRITON:
        pytest.skip("triton not importable")
    if not triton_library_interpreted():
        pytest.skip("Triton compiles in this process (a CUDA machine, where tests/conftest.py leaves its "
                    "interpreter off); tests/test_cuda.py checks its kernels on the GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["eager", "compile", "triton"])
def family(request, monkeypatch):
    """Runs a test once per kernel family; Triton runs in its CPU interpreter. A test for some
    families only names them: ``@pytest.mark.parametrize("family", [...], indirect=True)``."""
    name = request.param
    if name == "compile" and not COMPILE_TESTS:
        pytest.skip("set MEGAPIPE_TEST_COMPILE=1 to test the torch.compile kernels")
    if name == "triton":
        _interpret_triton(monkeypatch)
    previous = backend.activate(backend.FusionBackend(name, "test"))
    yield name
    backend.activate(previous)


@pytest.fixture
def triton_family(monkeypatch):
    """Triton's kernels alone, in its CPU interpreter (for what only Triton does, such as its own
    dropout mask)."""
    _interpret_triton(monkeypatch)
    previous = backend.activate(backend.FusionBackend("triton", "test"))
    yield "triton"
    backend.activate(previous)


def triton_library_interpreted() -> bool:
    """Whether Triton's own library functions run in its interpreter in this process (decided when
    triton was imported; tests/conftest.py imports it so on machines without CUDA)."""
    if not HAS_TRITON:
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


@pytest.fixture
def restore_backend():
    """Puts back whichever backend was active once a test that selects one is done."""
    previous = backend.activate(None)
    yield
    backend.activate(previous)


@pytest.fixture
def eager_backend():
    previous = backend.activate(backend.FusionBackend("eager", "test"))
    yield
    backend.activate(previous)


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same fp32 formula, different operation order: a few ULP (2^-23 = 1.2e-7) apart at most.

    1e-6 relative to each element plus 1e-6 of the tensor's largest magnitude (for elements
    that cancel to near zero, such as bias-gradient sums) allows about 8 ULP and no more.
    """
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def assert_bf16_rounded(actual: torch.Tensor, expected_fp32: torch.Tensor, family: str = "eager",
                        roundings: int = 1) -> None:
    """``actual`` is the fp32 value ``expected_fp32`` after ``roundings`` roundings to bf16.

    Rounding to nearest costs at most half a bf16 ULP, at most 2^-8 relative (8 significant
    bits); the fp32 computation adds ~1e-6 of the tensor's scale. Triton's CPU interpreter
    converts fp32 to bf16 by truncation (measured; GPUs round to nearest), which costs up to a
    whole ULP, 2^-7 relative.
    """
    assert actual.dtype == torch.bfloat16
    rtol = roundings * (2**-7 if family == "triton" else 2**-8)
    torch.testing.assert_close(actual.float(), expected_fp32, rtol=rtol, atol=1e-5 * expected_fp32.abs().max().item())


def grads(output: torch.Tensor, grad_output: torch.Tensor, *inputs: torch.Tensor):
    """The gradients of ``(output * grad_output).sum()`` for ``inputs``."""
    return torch.autograd.grad(output, inputs, grad_output)
