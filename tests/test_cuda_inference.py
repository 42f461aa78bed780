"""GPU acceptance of inference (``-m cuda``, run by tools/gpu_check.sh): on the GPU, generation gives
the CPU's greedy tokens, samples reproducibly whatever the microbatches, reads the GPU back only for
its answer (and, with stop tokens, once per microbatch step), and scoring gives the CPU's
log-likelihoods; the host/device mixing the fake device refuses is refused by the GPU too. Skipped
where no CUDA device exists."""

import warnings

import pytest
import torch

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.parallel.launch import default_device
from megapipe.fusions import backend
from megapipe.inference import SamplingParams, generate, score_continuations
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.peer_messages import PeerMessages

DEVICE = default_device()
pytestmark = [pytest.mark.unit, pytest.mark.cuda, pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21]]
SAMPLED = dict(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.3, seed=7)


@pytest.fixture(scope="module")
def models():
    """A small Llama (RMSNorm, rotary, SwiGLU, grouped-query attention) in fp32 on the CPU and on the
    GPU, with the same weights (drawn on the host, keyed by name). Initial weights of std 0.3 put the
    logits far apart, so no near-tie decides a greedy token when the GPU sums in another order."""
    previous = backend.activate(None)
    fusions.select_backend("eager", DEVICE)
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=211,
                         seq_length=48, max_position_embeddings=48, normalization="RMSNorm",
                         position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                         untie_embeddings_and_output_weights=True, init_method_std=0.3, hidden_dropout=0.0,
                         attention_dropout=0.0)
    ps = ParallelState.single()
    cpu, gpu = (build_model_chunks("gpt", config, ps, device=d)[0].eval() for d in (torch.device("cpu"), DEVICE))
    for (name, a), b in zip(cpu.state_dict().items(), gpu.state_dict().values()):
        assert torch.equal(a, b.cpu()), name
    yield config, ps, cpu, gpu
    backend.activate(previous)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_greedy_generation_on_the_gpu_equals_the_cpu(models, padding):
    config, ps, cpu, gpu = models
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, repetition_penalty=1.2)
    expected = generate([cpu], ps, config, PROMPTS, greedy, padding=padding)
    for m in (1, 2):
        assert generate([gpu], ps, config, PROMPTS, greedy, padding=padding, microbatches=m) == expected


def test_sampling_on_the_gpu_is_reproducible_whatever_the_microbatches(models):
    config, ps, _, gpu = models
    sampled = SamplingParams(max_new_tokens=16, **SAMPLED)
    whole = generate([gpu], ps, config, PROMPTS, sampled, microbatches=1)
    assert generate([gpu], ps, config, PROMPTS, sampled, microbatches=3) == whole
    assert generate([gpu], ps, config, PROMPTS[:2], sampled) == whole[:2]
    assert len({tuple(tokens) for tokens in whole}) == len(whole)


def _synchronisations(run) -> int:
    """How many times ``run()`` makes the host wait for the GPU (CUDA's synchronisation warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# a stop token outside the vocabulary is never drawn, so every step is taken and counted
@pytest.mark.parametrize("stops", [(), (1000,)], ids=["no-stop-tokens", "stop-tokens"])
def test_decode_steps_wait_for_the_gpu_only_to_decide_stopping(models, stops):
    """The synchronisations of 12 more tokens: none without stop tokens, one per microbatch step with."""
    config, ps, _, gpu = models

    def run(new):
        params = SamplingParams(max_new_tokens=new, stop_tokens=stops, **SAMPLED)
        return lambda: generate([gpu], ps, config, PROMPTS, params, microbatches=2)

    generate([gpu], ps, config, PROMPTS, SamplingParams(max_new_tokens=2))  # first-call set-up is not the point
    extra = _synchronisations(run(16)) - _synchronisations(run(4))
    assert extra == (2 * 12 if stops else 0)


def test_scoring_on_the_gpu_equals_the_cpu(models):
    """fp32 log-likelihoods summed over a few tokens: the GPU's kernels reduce in another order (~1e-6
    relative apart), so 1e-5 relative bounds it; the greedy flags are equal."""
    config, ps, cpu, gpu = models
    pairs = [(PROMPTS[0], PROMPTS[1]), (PROMPTS[2], [17]), (PROMPTS[3], PROMPTS[0])]
    expected = score_continuations([cpu], ps, config, pairs)
    got = score_continuations([gpu], ps, config, pairs)
    assert [g for _, g in got] == [g for _, g in expected]
    assert [s for s, _ in got] == pytest.approx([s for s, _ in expected], rel=1e-5)


def test_the_gpu_refuses_what_the_fake_device_refuses():
    """A host generator drawing for GPU rows, a host index scattered into GPU logits, and a host tensor
    handed to pipeline messages on a GPU run."""
    probs = torch.full((8,), 1 / 8, device=DEVICE)
    with pytest.raises(RuntimeError):
        torch.multinomial(probs, 1, generator=torch.Generator())
    with pytest.raises(RuntimeError):
        torch.zeros(2, 8, dtype=torch.bool, device=DEVICE).scatter_(1, torch.zeros(2, 3, dtype=torch.long), True)
    with pytest.raises(RuntimeError, match=f"is on cpu but this run computes on {DEVICE}"):
        PeerMessages(ParallelState.single(), DEVICE).send(torch.zeros(4, dtype=torch.long), 1, "step header")
