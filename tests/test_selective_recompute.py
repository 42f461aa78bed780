"""Selective recomputation (``models/selective.py``): bit for bit the training without it, and what it keeps.

The norms', RoPE's and the activation's outputs and the dropout masks are recomputed in the backward pass, so
losses and gradients must equal those without recomputation exactly (fp32, dropout on): for GPT, BERT and
Llama layers with and without qk-norms, when the backward is split into BI and BW as the zero-bubble schedules
split it, when the weights are replaced between forward and backward as PipeDream's updates replace them, under
tensor and sequence parallelism, and inside the zero-bubble and PipeDream schedules. The bytes autograd keeps,
counted through saved-tensor hooks as a memory profiler counts them, are what the planner's formula says.
"""

import datetime

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.func import functional_call

from megapipe import fusions
from megapipe.models import build_model_chunks
from megapipe.models.transformer import TransformerLayer
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.planner.analytic import attention_core_bytes, block_stash_bytes
from megapipe.planner.profile import ModelShape
from megapipe.tensor_parallel.split_backward import apply_weight_gradients, deferring_weight_gradients
from megapipe.testing.worlds import run_distributed
from fusion_helpers import family  # noqa: F401 - the kernel-family fixture
from model_families import family_config
from test_recompute import batch, config, loss_and_grads

SEQ = 16
LAYERS = {"gpt": ("gpt", {}), "bert": ("bert", {}), "llama": ("llama", {}),
          "llama-qk-norm": ("llama", dict(qk_layernorm=True)),
          "llama-qk-norm-projection": ("llama", dict(qk_layernorm=True, qk_layernorm_scope="projection", swiglu=False,
                                                     normalization="LayerNorm", add_bias_linear=True))}


def layer_config(name: str, **fields):
    kind, extra = LAYERS[name]
    sizes = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=64,
                 hidden_dropout=0.1, attention_dropout=0.1)
    return family_config(kind, **{**sizes, **extra, **fields})


def build_layer(cfg, ps=None):
    ps = ps or ParallelState.single()
    ps.seed(3, torch.device("cpu"))
    return TransformerLayer(cfg, ps, 0, seed=7).train()


def rotary(cfg):
    if cfg.position_embedding_type != "rope":
        return None
    return fusions.rotary_tables(torch.arange(SEQ).unsqueeze(0), cfg.rotary_dim, cfg.rotary_base)


def inputs(cfg, micro=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(SEQ, micro, cfg.hidden_size, generator=g), torch.randn(SEQ, micro, cfg.hidden_size, generator=g)


def run_layer(cfg, split=False, weights=None, change_live_weights=False):
    """Output, input gradient and weight gradients of one layer's forward and backward (two micro-batches, so the
    random streams must continue identically); ``split``: backward as BI then BW; ``weights``: the forward runs on
    these tensors (a stashed version) and, with ``change_live_weights``, the layer's own change before backward."""
    layer, results = build_layer(cfg), []
    versions = {name: p.detach().clone().requires_grad_() for name, p in layer.named_parameters()} if weights else None
    for _ in range(2):
        x, grad = inputs(cfg)
        x.requires_grad_()
        args = (x, None, True, rotary(cfg))
        out = functional_call(layer, versions, args) if versions else layer(*args)
        if change_live_weights:
            with torch.no_grad():
                for p in layer.parameters():
                    p.mul_(1.5)
        if split:
            deferred = []
            with deferring_weight_gradients(deferred):
                out.backward(grad)
            apply_weight_gradients(deferred)
        else:
            out.backward(grad)
        results += [out.detach(), x.grad]
    params = versions.values() if versions else layer.parameters()
    return results + [p.grad for p in params]


def assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_are_bit_for_bit_with_dropout(name):
    assert_equal(run_layer(layer_config(name, recompute_granularity="selective")), run_layer(layer_config(name)))


@pytest.mark.unit
@pytest.mark.parametrize("family", ["eager", "compile", "triton"], indirect=True)
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_layers_are_bit_for_bit_under_each_kernel_family(name, family):
    """Triton's norms and elementwise kernels (in its CPU interpreter here) and torch.compile's recompute too."""
    assert_equal(run_layer(layer_config(name, recompute_granularity="selective")), run_layer(layer_config(name)))


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_split_backward_recomputes_inside_bi(name):
    """BI (weight gradients deferred) recomputes; BW's products then read the recomputed inputs."""
    reference = run_layer(layer_config(name))
    assert_equal(run_layer(layer_config(name, recompute_granularity="selective"), split=True), reference)


@pytest.mark.unit
def test_recomputation_reads_the_weights_the_forward_ran_on():
    """The forward runs on a stashed copy of the weights; the live ones change before the backward, as an update
    of PipeDream's does. Recomputed norms and activations must use the copy."""
    cfg = layer_config("bert", recompute_granularity="selective")  # LayerNorm weights and biases, GeLU's bias
    assert_equal(run_layer(cfg, weights=True, change_live_weights=True), run_layer(cfg, weights=True))


@pytest.mark.unit
def test_an_input_changed_in_place_after_the_forward_is_refused():
    cfg = layer_config("gpt", recompute_granularity="selective", hidden_dropout=0.0, attention_dropout=0.0)
    layer = build_layer(cfg)
    x = inputs(cfg)[0].requires_grad_()
    hidden = x * 1.0  # an activation (not a leaf), as a layer's input is
    out = layer(hidden, None, True)
    with torch.no_grad():
        hidden.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after the forward pass"):
        out.sum().backward()


def saved_bytes(cfg, micro):
    """Bytes of the distinct storages autograd keeps for one layer's backward, parameters left out."""
    layer = build_layer(cfg)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor
    x = inputs(cfg, micro)[0].requires_grad_()
    with saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layer(x, None, True)
    out.sum().backward()
    return sum(kept.values())


@pytest.mark.unit
def test_saved_bytes_are_the_planners():
    """A GPT layer (fp32, hidden dropout on) keeps what ``planner.analytic.block_stash_bytes`` says under selective
    recomputation. At b = 1 the attention kernel's [b, s, heads, d] output is already [s, b, h] ordered, so the
    output projection keeps a view of it, as on GPUs at every b. The formula leaves out explicit attention's
    [s, s] tensors (SDPA keeps a log-sum-exp instead: 4 bytes per head and token) and the norms' statistics
    (mean and 1/std, 4 bytes each, per norm and token)."""
    b, e = 1, 4
    cfg = layer_config("gpt", attention_dropout=0.0)
    shape = ModelShape("gpt", cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, SEQ, cfg.vocab_size,
                       cfg.ffn_hidden_size)
    tokens, heads = SEQ * b, cfg.num_attention_heads
    small = tokens * (4 * heads + 2 * 8)
    selective = saved_bytes(layer_config("gpt", attention_dropout=0.0, recompute_granularity="selective"), b)
    planned = block_stash_bytes(shape, b, e, 0, selective=True)[0] - attention_core_bytes(shape, b, e)
    assert selective == planned + small
    assert block_stash_bytes(shape, b, 2, 0, selective=True)[0] == (20 * tokens * cfg.hidden_size
                                                                    + attention_core_bytes(shape, b, 2))  # bf16
    # without recomputation it also keeps the 2 norm outputs, GeLU's output and the 2 masks (e bytes on CPU)
    freed = (2 * e + 2 * e) * tokens * cfg.hidden_size + e * tokens * cfg.ffn_hidden_size
    assert saved_bytes(cfg, b) == selective + freed


def parallel_and_pipelined(rank, world_size):
    """t = 2 with and without sequence parallelism, then at p = 2 ZB-H1 (split backward) and PipeDream (weight
    stashing): selective recomputation trains exactly as no recomputation."""
    for sequence_parallel in (False, True):
        ps = ParallelState.initialize(tensor=2)
        runs = [loss_and_grads("llama", config("llama", **extra), ps, sequence_parallel=sequence_parallel)
                for extra in ({}, dict(recompute_granularity="selective"))]
        assert all(torch.equal(x, y) for x, y in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]))
    for schedule in ("zb-h1", "pipedream"):
        results = []
        for extra in ({}, dict(recompute_granularity="selective")):
            ps = ParallelState.initialize(pipeline=2)
            ps.seed(5, torch.device("cpu"))
            cfg = config("gpt", untie_embeddings_and_output_weights=True, **extra)  # PipeDream's stages update apart
            engine = PipelineEngine(build_model_chunks("gpt", cfg, ps), ps,
                                    OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0, clip_grad=0.0),
                                    schedule, 4, (SEQ, 3, cfg.hidden_size), timeout=datetime.timedelta(seconds=60))
            losses = [engine.train_batch([batch("gpt", cfg, 4 * s + i) for i in range(4)]).losses for s in range(2)]
            losses.append(engine.drain().losses)  # PipeDream's last forwards are still in flight: their messages
            # must be matched before a rank leaves, or its peer's next send finds the connection closed
            results.append((losses, [p.detach().clone() for p in engine.chunks[0].parameters()]))
        assert results[0][0] == results[1][0], schedule
        assert all(torch.equal(x, y) for x, y in zip(results[0][1], results[1][1])), schedule
    return True


@pytest.mark.distributed
def test_selective_under_tensor_and_sequence_parallelism_and_pipeline_schedules():
    assert run_distributed(2, parallel_and_pipelined, timeout=240) == [True, True]
