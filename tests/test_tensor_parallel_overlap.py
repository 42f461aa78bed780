"""The column-parallel linears' collectives behind their backward products (``tensor_parallel/column_input.py``)
compute what the separate autograd functions compute, bit for bit, and keep less.

On two gloo ranks at t = 2, a GPT and a Llama-shaped GPT with and without sequence parallelism give the same
loss and the same gradients (``torch.equal``) with the overlap on and off, also with the weight gradients
deferred to a zero-bubble BW and with FP8 products (emulated, both recipes): every product and every sum is
the same operation on the same operands, only issued earlier. With sequence parallelism the backward keeps
this rank's rows of each column-parallel input (QKV, fc1 and the output layer), no longer the gathered
input: the bytes kept fall by exactly that difference (``_kept_less``), and each layer's QKV and fc1
inputs start to be gathered again as soon as the gradients of the dense projection's and fc2's outputs arrive.
"""

import pytest
import torch
import torch.distributed as dist

from megapipe.fusions import fp8
from megapipe.fusions.fp8 import Fp8Recipe
from megapipe.fusions.fp8_mode import activate
from megapipe.models import build_model_chunks
from megapipe.models.state_dict import canonical_state_dict, local_state_dict
from megapipe.parallel.state import ParallelState
from megapipe.parallel.collectives import reduce_scatter_into
from megapipe.tensor_parallel.collective_matmul import scattered_product
from megapipe.tensor_parallel.column_input import ColumnInput, overlap_tensor_parallel_communication
from megapipe.tensor_parallel.split_backward import apply_weight_gradients, deferring_weight_gradients
from megapipe.testing.worlds import run_distributed
from model_families import MODEL_KIND
from test_tensor_parallel import SEQ, make_batch, model_config

pytestmark = pytest.mark.distributed


def _step(kind, config, ps, canonical, sequence_parallel, overlap, defer=False):
    """(loss, gradients by name, bytes of the distinct storages the backward keeps, re-gathers started early)
    of one step."""
    overlap_tensor_parallel_communication(overlap)
    early, prefetch = [], ColumnInput._prefetch
    ColumnInput._prefetch = lambda self, node: (early.append(node), prefetch(self, node))
    try:
        model = build_model_chunks(MODEL_KIND[kind], config, ps, sequence_parallel=sequence_parallel)[0]
        model.load_state_dict(local_state_dict(canonical, model, ps, config))
        kept = {}

        def keep(tensor):
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss = model(None, make_batch(kind, config))
        deferred = []
        if defer:
            with deferring_weight_gradients(deferred):
                loss.backward()
            apply_weight_gradients(deferred)
        else:
            loss.backward()
        return (loss.detach(), {name: p.grad for name, p in model.named_parameters()}, sum(kept.values()),
                len(early))
    finally:
        overlap_tensor_parallel_communication(True)
        ColumnInput._prefetch = prefetch


def _kept_less(config, recipe, sequence_parallel, batch_size=3, t=2):
    """How many fewer bytes the overlapped column-parallel products keep (fp32 activations, FP8 emulated).
    Without sequence parallelism both keep the same. With it, a product kept its gathered input (4 bytes an
    element; tensorwise FP8's linears, its quantised copy: 1 byte, and its 4-byte scale) and now keeps this rank's rows (4/t bytes
    an element). The column-parallel products: QKV and fc1 per layer (FP8 under a recipe) and the output
    layer (never FP8)."""
    if not sequence_parallel:
        return 0
    elements = SEQ * batch_size * config.hidden_size
    whole_in_linears = elements + 4 if recipe == "e4m3 tensorwise" else 4 * elements  # FP8 values and scale
    return 2 * config.num_layers * (whole_in_linears - 4 * elements // t) + (4 - 4 // t) * elements


def _checks(rank, world_size):
    ps = ParallelState.initialize(tensor=2)
    out = []
    cases = [(kind, sp, None, defer) for kind in ("gpt", "llama") for sp in (False, True) for defer in (False, True)]
    cases += [("gpt", sp, recipe, False) for sp in (False, True)
              for recipe in (Fp8Recipe("e4m3"), Fp8Recipe("hybrid", "rowwise"))]
    for kind, sp, recipe, defer in cases:
        config = model_config(kind)
        single = ParallelState.single()
        canonical = canonical_state_dict(build_model_chunks(MODEL_KIND[kind], config, single), single, config)
        previous = activate(recipe)
        try:
            with fp8.emulated():
                before = _step(kind, config, ps, canonical, sp, overlap=False)
                after = _step(kind, config, ps, canonical, sp, overlap=True, defer=defer)
        finally:
            activate(previous)
        same = torch.equal(before[0], after[0]) and before[1].keys() == after[1].keys() and all(
            torch.equal(before[1][name], after[1][name]) for name in before[1])
        out.append({"case": (kind, sp, str(recipe), defer), "same": same, "kept": (before[2], after[2]),
                    "kept less": _kept_less(config, str(recipe) if recipe else None, sp),
                    "early": (before[3], after[3]), "layers": config.num_layers})
    dist.barrier()
    return out


def test_overlapped_column_linears_equal_the_separate_collectives_bit_for_bit_and_keep_less():
    for rank_cases in run_distributed(2, _checks, timeout=240):
        for case in rank_cases:
            kind, sp, recipe, defer = case["case"]
            assert case["same"], case["case"]
            before, after = case["kept"]
            assert before - after == case["kept less"], case["case"]
            # with sequence parallelism QKV's and fc1's inputs are gathered again from the dense projection's
            # and fc2's output gradients on, in every layer; never without it or without the overlap
            assert case["early"] == (0, 2 * case["layers"] if sp else 0), case["case"]


def _ring_products(rank, world_size):
    """The forward products as collective matmuls against a collective and ``F.linear``: of each rank's rows of
    a sequence-parallel input (13 rows: uneven blocks for the kernels) gathered, with and without a bias; and of
    each rank's partial products of 52 rows reduce-scattered. The largest difference of each, relative to the
    largest value (a sum's rounding scales with its terms, not with a result that cancels near 0)."""
    ps = ParallelState.initialize(tensor=world_size)
    column = ColumnInput(ps.tp_group, sequence_parallel=True)
    generator = torch.Generator().manual_seed(rank)
    rows, partial_rows = torch.randn(13, 24, generator=generator), torch.randn(52, 24, generator=generator)
    weight, bias = torch.randn(10, 24, generator=generator), torch.randn(10, generator=generator)
    gathered = [(column.linear(rows, weight, b), torch.nn.functional.linear(column.gather(rows), weight, b))
                for b in (None, bias)]
    summed = torch.empty(13, 10)
    reduce_scatter_into(summed, torch.nn.functional.linear(partial_rows, weight), ps.tp_group)
    pairs = gathered + [(scattered_product(partial_rows, weight, ps.tp_group), summed)]
    return [float((ring - reference).abs().max() / reference.abs().max()) for ring, reference in pairs]


def test_the_collective_matmuls_around_a_ring_of_four_equal_the_collectives():
    # each gathered output row is the same product of the same input row, only computed while other rows
    # travel: the same bits; the reduce-scatter's sums add the same four partial products in the ring's order,
    # which may round differently from the collective's: a few fp32 ulps (1e-6 relative)
    for gathered, gathered_biased, scattered in run_distributed(4, _ring_products, timeout=120):
        assert gathered == gathered_biased == 0.0
        assert scattered < 1e-6
