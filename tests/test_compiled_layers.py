"""Regional compilation (``--fusion-backend compile``): each transformer layer compiled on its own.

Dynamo's ``explain`` finds no graph break in GPT, BERT and Llama layers (their own dropout, and selective
recomputation, included), and two layers of one stage compile to one forward and one backward graph. The
exactness checks compile with ``aot_eager``: it traces exactly what inductor is given (dynamo's graph, the
functionalised joint graph, the partition into forward and backward) but runs the traced ATen ops instead
of generating C++, so outputs and gradients must equal eager's bit for bit, and a check takes seconds
rather than the 20 s a cold inductor compile of a layer's forward and backward takes on a 2-core CPU.
Inductor's own code is checked on request (``MEGAPIPE_TEST_COMPILE=1``), within 1e-6 of the largest value:
its kernels sum the same fp32 terms in another order, a few ulps of the result (3e-7 measured).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import min_cut_rematerialization_partition

from fusion_helpers import COMPILE_TESTS
from model_families import MODEL_KIND, family_config
from megapipe.cli.parse import parse_config
from megapipe.errors import ConfigError
from megapipe.fusions import backend
from megapipe.models import MODEL_KINDS, build_model_chunks
from megapipe.models.compiled_layers import compile_layers
from megapipe.parallel.state import ParallelState
from megapipe.schedules.catalog import build_schedule, schedule_descriptor
from megapipe.tensor_parallel.split_backward import apply_weight_gradients, deferring_weight_gradients

pytestmark = pytest.mark.unit

SIZES = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
             vocab_size=64)
TOKENS, BATCH = 16, 2
BATCH_DICT = {"padding_mask": torch.ones(BATCH, TOKENS).index_fill_(1, torch.arange(12, TOKENS), 0)}  # BERT's


@pytest.fixture(autouse=True)
def eager_fusions():
    """Layers built here are compiled by the tests themselves; the fused ops outside a compiled region use
    PyTorch's kernels, the reference the compiled layers must equal."""
    previous = backend.activate(backend.FusionBackend("eager", "test"))
    yield
    backend.activate(previous)


def counting_backend():
    """``aot_eager`` (the traced ATen graphs run as they are) that counts the forward and backward graphs."""
    counts = {"forward": 0, "backward": 0}

    def counted(kind):
        def compile_graph(graph, inputs):
            counts[kind] += 1
            return boxed_nop(graph, inputs)
        return compile_graph

    return aot_autograd(fw_compiler=counted("forward"), bw_compiler=counted("backward"),
                        partition_fn=min_cut_rematerialization_partition), counts


def middle_stage(kind: str, **fields):
    """A stage of two layers with neither the embedding nor the head: hidden states in, hidden states out."""
    ps = ParallelState.single()
    ps.seed(1234, torch.device("cpu"))
    config = family_config(kind, **{**SIZES, **fields})
    return MODEL_KINDS[MODEL_KIND[kind]](config, ps, 0, 2, pre_process=False, post_process=False).train()


def run(stage, x: torch.Tensor, grad: torch.Tensor, seed: int = 7):
    """Forward and backward from the same random state: the output and every gradient."""
    for p in stage.parameters():
        p.grad = None
    x.grad = None
    torch.manual_seed(seed)
    out = stage(x, BATCH_DICT)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad for p in stage.parameters()]


def inputs():
    torch.manual_seed(0)
    x = torch.randn(TOKENS, BATCH, SIZES["hidden_size"], requires_grad=True)
    return x, torch.randn(TOKENS, BATCH, SIZES["hidden_size"])


@pytest.mark.parametrize("kind", ["gpt", "bert", "llama"])
@pytest.mark.parametrize("recompute", [None, "selective"])
def test_a_layer_traces_without_graph_breaks(kind, recompute):
    """The family's own dropout (0.1 for GPT and BERT) and RoPE (Llama) included."""
    fields = {} if kind == "llama" else dict(hidden_dropout=0.1, attention_dropout=0.1)
    stage = middle_stage(kind, recompute_granularity=recompute, **fields)
    layer, x = stage.layers["0"], inputs()[0]
    rotary = stage.rotary(x, None)
    explanation = torch._dynamo.explain(lambda h: layer(h, None, stage.causal, rotary))(x)
    assert explanation.graph_break_count == 0, [reason.reason for reason in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("kind", ["gpt", "bert", "llama"])
def test_compiled_layers_equal_eager_with_one_graph_each_way(kind):
    stage = middle_stage(kind, hidden_dropout=0.0, attention_dropout=0.0)
    x, grad = inputs()
    eager = run(stage, x, grad)
    names = list(stage.state_dict())
    compiler, counts = counting_backend()
    compile_layers([stage], backend=compiler)
    compiled = run(stage, x, grad)
    assert counts == {"forward": 1, "backward": 1}  # both layers share one graph each way
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)
    assert list(stage.state_dict()) == names


def test_split_backward_defers_the_weight_gradients_out_of_the_compiled_pieces():
    """Under a zero-bubble schedule's BI the linears run between compiled pieces and defer their weight
    gradients; BW then brings every gradient to eager's, bit for bit."""
    stage = middle_stage("gpt", hidden_dropout=0.0, attention_dropout=0.0)
    x, grad = inputs()
    eager = run(stage, x, grad)
    compiler, counts = counting_backend()
    compile_layers([stage], split_backward=True, backend=compiler)
    for p in stage.parameters():
        p.grad = None
    x.grad = None
    out, deferred = stage(x, BATCH_DICT), []
    with deferring_weight_gradients(deferred):
        out.backward(grad)
    linears = [linear for layer in stage.layers.values()
               for linear in (layer.attention.qkv, layer.attention.dense, layer.mlp.fc1, layer.mlp.fc2)]
    assert len(deferred) == len(linears) and all(linear.weight.grad is None for linear in linears)
    apply_weight_gradients(deferred)
    assert counts["forward"] == counts["backward"] > 1  # the pieces between the linears
    for got, want in zip([out.detach(), x.grad] + [p.grad for p in stage.parameters()], eager, strict=True):
        assert torch.equal(got, want)


def test_full_recomputation_replays_the_compiled_layers_dropout():
    """Checkpointed compiled layers run again in the backward pass from the forward's random state: the
    gradients equal those of the compiled layers without recomputation, dropout included."""
    x, grad = inputs()
    results = []
    for recompute in (None, "full"):
        stage = middle_stage("gpt", recompute_granularity=recompute, recompute_method="uniform",
                             recompute_num_layers=1 if recompute else None)
        compile_layers([stage], backend="aot_eager")
        results.append(run(stage, x, grad))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(not COMPILE_TESTS, reason="set MEGAPIPE_TEST_COMPILE=1 to test inductor's code (20 s cold)")
def test_inductor_compiled_layers_equal_eager_within_fp32_rounding():
    stage = middle_stage("gpt", hidden_dropout=0.0, attention_dropout=0.0)
    x, grad = inputs()
    eager = run(stage, x, grad)
    compile_layers([stage])
    for got, want in zip(run(stage, x, grad), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())


def test_a_failed_compilation_is_refused_in_one_sentence():
    def no_compiler(graph, inputs):
        raise RuntimeError("Failed to find a C++ compiler")

    stage = middle_stage("gpt")
    compile_layers([stage], backend=no_compiler)
    with pytest.raises(ConfigError, match=r"^--fusion-backend compile failed to compile transformer layer 0 "
                                          r"\(RuntimeError: Failed to find a C\+\+ compiler\); use --fusion-backend "
                                          r"triton or eager\.$"):
        stage(inputs()[0], BATCH_DICT)


def test_asking_for_compile_where_it_cannot_run_is_refused(monkeypatch):
    def failing(device):
        raise RuntimeError("C++ compile error")

    monkeypatch.setitem(backend._PROBES, "compile", failing)
    backend.run_problem.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"^--fusion-backend compile cannot run on cpu: compile imports but "
                                              r"fails to run \(RuntimeError: C\+\+ compile error\); use "
                                              r"--fusion-backend auto, triton or eager\.$"):
            backend.select_backend("compile", torch.device("cpu"))
    finally:
        backend.run_problem.cache_clear()


def test_compiled_moe_layers_are_refused_at_flag_checking():
    with pytest.raises(ConfigError, match="^--fusion-backend compile cannot compile MoE layers"):
        parse_config("gpt", ["--fusion-backend", "compile", "--num-experts", "4", "--disable-bias-linear"])


def test_the_models_builder_compiles_under_the_compile_backend(monkeypatch):
    built = []
    monkeypatch.setattr("megapipe.models.compile_layers", lambda chunks, split: built.append(split))
    config = family_config("gpt", **SIZES)
    build_model_chunks("gpt", config, ParallelState.single())
    backend.activate(backend.FusionBackend("compile", "test"))
    build_model_chunks("gpt", config, ParallelState.single(), split_backward=True)
    assert built == [True]


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"])
def test_a_schedule_splits_backwards_as_its_descriptor_says(name):
    """What the trainer tells the compiled layers: a named schedule's descriptor, a file's own lists."""
    chunks = 2 if schedule_descriptor(name).chunked else 1
    assert build_schedule(name, 2, 4, chunks).splits_backward == schedule_descriptor(name).split_backward
