"""The fusion backend is chosen by running each kernel family, not by finding its package: a family
that imports but fails on the device is passed over, with the reason in the start-up line."""

import pytest
import torch

from fusion_helpers import restore_backend  # noqa: F401 (fixture)
from megapipe.errors import ConfigError
from megapipe.fusions import backend

pytestmark = pytest.mark.unit

CUDA = torch.device("cuda")


@pytest.fixture
def pretend_installed(monkeypatch, restore_backend):
    """apex and Triton importable, their probes replaceable; the probe cache emptied around the test."""
    monkeypatch.setattr(backend, "importable", lambda package: True)
    backend.run_problem.cache_clear()
    yield monkeypatch
    backend.run_problem.cache_clear()


def failing(message):
    def probe(device):
        raise RuntimeError(message)
    return probe


def test_a_triton_that_cannot_build_its_launcher_is_passed_over(pretend_installed):
    pretend_installed.setitem(backend._PROBES, "apex", failing("fused_layer_norm_cuda: undefined symbol"))
    pretend_installed.setitem(backend._PROBES, "triton", failing("Failed to find C compiler"))
    chosen = backend.select_backend("auto", CUDA)
    assert chosen.name == "eager"
    assert "apex imports but fails to run (RuntimeError: fused_layer_norm_cuda: undefined symbol)" in chosen.reason
    assert "triton imports but fails to run (RuntimeError: Failed to find C compiler)" in chosen.reason


def test_compile_on_cuda_needs_a_triton_that_runs(pretend_installed):
    """Asked for explicitly, torch.compile is refused rather than replaced: it compiles each whole layer."""
    pretend_installed.setitem(backend._PROBES, "triton", failing("Failed to find C compiler"))
    with pytest.raises(ConfigError, match=r"^--fusion-backend compile cannot run on cuda: torch.compile on CUDA needs "
                                          r"a working triton \(triton imports but fails to run \(RuntimeError: Failed "
                                          r"to find C compiler\)\); use --fusion-backend auto, triton or eager\.$"):
        backend.select_backend("compile", CUDA)


def test_a_family_whose_probe_runs_is_chosen_and_probed_once(pretend_installed):
    calls = []
    pretend_installed.setitem(backend._PROBES, "apex", failing("no CUDA extension"))
    pretend_installed.setitem(backend._PROBES, "triton", calls.append)
    for _ in range(3):
        assert backend.select_backend("auto", CUDA).name == "triton"
    assert calls == [CUDA]


def test_on_the_cpu_no_probe_runs(pretend_installed):
    pretend_installed.setitem(backend._PROBES, "triton", failing("must not run on a CPU device"))
    pretend_installed.delenv("TRITON_INTERPRET", raising=False)
    chosen = backend.select_backend("triton", torch.device("cpu"))
    assert chosen.name == "eager" and chosen.reason.startswith("triton requested, but triton needs CUDA")
