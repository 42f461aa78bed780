"""Context-parallel training equals single-process training with gradient accumulation.

The harness of ``test_pipeline_training.py``: the same model (4 layers), microbatches, SGD with momentum and
3 steps, and the same reference (one process accumulating the m x d microbatches of each step);
under context parallelism every rank trains on its two chunks of each sequence (``context_share``).
The per-microbatch losses (each context rank reports the whole sequence's) and every parameter
after 3 steps must equal the reference's within 1e-5 relative, in fp32, for GPT and a Llama-shaped
GPT (RoPE, grouped-query attention with 2 groups) at c = 2 and 4 under each comm type (a2a where
the local heads and query groups divide by c), with t = 2 (with sequence parallelism, and with full
recomputation), with p = 2 under 1F1B and interleaved
1F1B, with d = 2 and ZeRO-1; for BERT (bidirectional, padding, the sentence-order head on [CLS],
which only context rank 0 holds); for a mixture-of-experts Llama (the balancing and z losses, whose
gradients must be the whole sequence's too); and for packed documents with reset positions and attention
masks, against one process that masks the same way. One world of 4 processes per family.

Composed with the rest, at c = 2: p = 2 under zero bubble (ZB-H1, with recomputation: the backward split into
input and weight gradients) and the V placement (ZBV, DualPipeV; BERT's [CLS] and loss back on the first pipeline
rank), against the same reference; experts split over e = 2 ranks (folded over the c x d ranks, and over the
context ranks of a stage alone at p = 2) at every sharding level; d = 2 with ZeRO-2 and ZeRO-3; the asynchronous
PipeDream (weight stashing) and PipeDream-2BW against the sequential emulator of ``test_async_training.py``; and
bf16 and fp16 (its dynamic loss scaler skipping the same overflowing steps) against c = 1 in the same precision,
within the tolerances ``check_precision`` explains.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from batch_helpers import packed_microbatch
from test_async_training import Case, check_case, emulated, pipelined
from test_pipeline_training import (MICRO, SEQ, STEPS, assert_matches_reference, pipelined_run,
                                    reference_run)
from megapipe.optim import OptimizerConfig
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
LAYERS = 4  # the pipeline tests' model with 4 of its 8 layers: p = 2 with v = 2 still has one per chunk


def sgd(sharding: str = "no_shard", **precision) -> OptimizerConfig:
    """``optimizer_config``'s SGD at a sharding level (ZeRO-1 ``optim``, ZeRO-2 ``optim_grads``, ZeRO-3
    ``optim_grads_params``), in a precision (``bf16`` or ``fp16`` with its loss-scaling fields)."""
    return OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.9, weight_decay=0.0, clip_grad=0.0,
                           data_parallel_sharding_strategy=sharding, **precision)


def packed(kind, config, step, index):
    return packed_microbatch(config.vocab_size, MICRO, SEQ, seed=1000 * step + index)


def cases(kind: str) -> list[dict]:
    """(t, c, p, d) layouts of a world of 4 and how each runs; a2a where heads and query groups allow."""
    groups = 2 if kind == "llama" else 4  # query groups of the test model (4 heads)
    out = []
    for comm in COMM_TYPES:
        split = {"a2a": 4, "a2a+p2p": 2}.get(comm, 1)  # ranks the heads are split over at c = 4
        if groups % split == 0:
            out.append(dict(t=1, c=4, p=1, d=1, comm=comm))
        if comm != "a2a+p2p" and groups % (2 if comm == "a2a" else 1) == 0:
            out.append(dict(t=1, c=2, p=1, d=2, comm=comm, sharding="optim"))
    out += [dict(t=2, c=2, p=1, d=1, comm="p2p", sequence_parallel=True),
            dict(t=2, c=2, p=1, d=1, comm="all_gather", recompute=True),
            dict(t=1, c=2, p=2, d=1, comm="p2p", schedule="1f1b"),
            dict(t=1, c=2, p=2, d=1, comm="all_gather", schedule="interleaved", v=2),
            dict(t=1, c=2, p=2, d=1, comm="p2p", schedule="zb-h1", recompute=True),
            dict(t=1, c=2, p=2, d=1, comm="all_gather", schedule="zbv", v=2),
            dict(t=1, c=2, p=2, d=1, comm="a2a", schedule="dualpipev", v=2),
            dict(t=1, c=2, p=1, d=2, comm="p2p", sharding="optim_grads"),
            dict(t=1, c=2, p=1, d=2, comm="all_gather", sharding="optim_grads_params")]
    if groups // 2 % 2 == 0:  # a2a under t = 2: the local query groups divide by c
        out.append(dict(t=2, c=2, p=1, d=1, comm="a2a"))
    return out


def check_family(rank, world_size, kind, layouts, packed_documents=False):
    batch = packed if packed_documents else None
    extra = dict(num_layers=LAYERS, **({"microbatch": batch} if batch else {}))
    references = {d: reference_run(kind, d, **extra) for d in sorted({case["d"] for case in layouts})}
    checked = []
    for case in layouts:
        layout = dict(context=case["c"], cp_comm_type=case["comm"], expert=case.get("e", 1))
        if case["comm"] == "a2a+p2p":
            layout["hierarchical_context"] = (2, case["c"] // 2)
        schedule, v = case.get("schedule", "1f1b"), case.get("v", 1)
        what = f"{kind} {case}"
        ps, losses, final = pipelined_run(kind, case["t"], case["p"], case["d"], schedule, v,
                                          references[case["d"]][0], recompute=case.get("recompute", False),
                                          layout=layout, optimizer=sgd(case.get("sharding", "no_shard")),
                                          sequence_parallel=case.get("sequence_parallel", False), **extra)
        assert (ps.cp_size, ps.ep_size) == (case["c"], case.get("e", 1))
        assert_matches_reference(ps, losses, final, references[case["d"]], what)
        checked.append(what)
    return checked


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_context_parallel_matches_single_process(kind):
    layouts = cases(kind)
    results = run_distributed(4, check_family, kind, layouts, timeout=600)
    assert len(results[0]) == len(layouts)


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_RTOL = 2.0 ** -8  # bf16's resolution: one rounding of a loss of about 4.6
UPDATE_RTOL = 2.0 ** -4  # of each tensor's largest update: see check_precision
# overflows this model's first two steps in fp16 at c = 1 and 2 alike, then fits; each context rank's backward
# carries c times its share of the loss (Megatron's rule), so at 2^18 c = 2 would overflow where c = 1 does not
FP16_SCALE = 2.0 ** 19


def gathered_losses(ps, losses) -> list[list[float]]:
    """Per step, the losses of all d x m microbatches of a run, in order, from every data-parallel replica's
    last stage (collective over the world)."""
    mine = (ps.dp_rank, losses) if ps.is_last_stage and ps.cp_rank == 0 and ps.tp_rank == 0 else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    replicas = sorted(entry for entry in everyone if entry is not None)
    return [[loss for _, steps in replicas for loss in steps[step]] for step in range(STEPS)]


def check_precision(precision, context_case):
    """A GPT in ``precision`` at c = 2 (``context_case``: t, p, d, comm type, schedule, v) against c = 1 (d = 4, m = 2:
    the same 8 microbatches a step) in the same precision, from the same weights.

    The two runs round differently: at c = 2 attention runs on blocks whose partial sums and log-sum-exp merge
    round in another order than one softmax, so activations and gradients differ by a few roundings at the
    format's resolution (2^-8 in bf16, 2^-11 in fp16). Losses therefore agree to 2^-8 relative. The fp32
    masters' updates after 3 steps agree to 2^-4 of each tensor's largest update: a few roundings of each
    gradient element, and once more through the rounded weights the next step runs on (measured: 1.7% in bf16,
    0.6% in fp16, both norm weights, whose small updates sit nearest the weights' own resolution; losses 8e-5 and
    8e-6 relative); a gradient lost or counted twice on a context rank moves an update by 100%. fp16's dynamic
    loss scaler must skip exactly the steps that overflow at c = 1."""
    dtype = PRECISIONS[precision]
    fields = {precision: True}
    if precision == "fp16":
        fields.update(initial_loss_scale=FP16_SCALE, hysteresis=1)
    initial = reference_run("gpt", 1, num_layers=LAYERS)[0]
    skipped, context_skipped = [], []
    ps_one, one_losses, one_final = pipelined_run("gpt", 1, 1, 4, "1f1b", 1, initial, m=2, optimizer=sgd(**fields),
                                                  num_layers=LAYERS, dtype=dtype, skipped=skipped)
    t, p, d, comm, schedule, v = context_case
    m = 8 // d
    ps, losses, final = pipelined_run("gpt", t, p, d, schedule, v, initial, m=m, optimizer=sgd(**fields),
                                      layout=dict(context=2, cp_comm_type=comm), num_layers=LAYERS, dtype=dtype,
                                      skipped=context_skipped)
    what = f"{precision} c=2 {context_case}"
    assert context_skipped == skipped, f"{what}: skipped steps {context_skipped}, at c = 1 {skipped}"
    if precision == "fp16":
        assert skipped[0] and not all(skipped), f"{what}: the loss scaler skipped {skipped}"
    expected = gathered_losses(ps_one, one_losses)
    if ps.is_last_stage:
        for step in range(STEPS):
            torch.testing.assert_close(torch.tensor(losses[step]), torch.tensor(expected[step][ps.dp_rank * m:][:m]),
                                       rtol=LOSS_RTOL, atol=0.0, msg=lambda e: f"{what} losses of step {step}: {e}")
    for name, value in final.items():
        update, reference = value - initial[name], one_final[name] - initial[name]
        torch.testing.assert_close(update, reference, rtol=0.0, atol=UPDATE_RTOL * reference.abs().max().item(),
                                   msg=lambda e: f"{what} update of {name}: {e}")
    return what


# PipeDream and 2BW at c = 2, p = 2: each context rank of a stage stashes and updates its versions on its own
ASYNC_CASES = [Case("gpt", "pipedream", 2, c=2), Case("gpt", "pipedream", 2, c=2, vertical_sync=True),
               Case("gpt", "2bw", 2, c=2), Case("bert", "2bw", 2, c=2)]


def other_families_and_compositions(rank, world_size, async_initials):
    """BERT, the MoE Llama with experts over 1 and 2 ranks, packed documents, bf16 and fp16 (checked here), and
    the asynchronous runs (returned, for the emulator's check)."""
    bert = check_family(rank, world_size, "bert", [dict(t=1, c=2, p=1, d=2, comm="p2p"),
                                                   dict(t=1, c=2, p=2, d=1, comm="all_gather"),
                                                   dict(t=1, c=2, p=2, d=1, comm="p2p", schedule="zbv", v=2)])
    moe = check_family(rank, world_size, "moe", [dict(t=1, c=2, p=1, d=2, comm="p2p"),
                                                 dict(t=1, c=4, p=1, d=1, comm="all_gather"),
                                                 dict(t=1, c=2, p=1, d=2, comm="p2p", e=2, sharding="optim_grads"),
                                                 dict(t=1, c=2, p=1, d=2, comm="all_gather", e=2, sharding="optim"),
                                                 dict(t=1, c=2, p=1, d=2, comm="a2a", e=2,
                                                      sharding="optim_grads_params"),
                                                 dict(t=1, c=2, p=2, d=1, comm="p2p", e=2, schedule="zb-h1")])
    documents = check_family(rank, world_size, "gpt", [dict(t=1, c=2, p=1, d=2, comm="p2p"),
                                                       dict(t=1, c=4, p=1, d=1, comm="all_gather")],
                             packed_documents=True)
    precisions = [check_precision("bf16", (1, 1, 2, "p2p", "1f1b", 1)),
                  check_precision("fp16", (1, 2, 1, "all_gather", "1f1b", 1))]
    asynchronous = [pipelined(case, initial) for case, initial in zip(ASYNC_CASES, async_initials)]
    return bert + moe + documents + precisions, asynchronous


def test_other_families_and_compositions():
    """BERT at c = 2 (with d = 2, p = 2 and ZBV); a mixture-of-experts Llama (both balancing losses over the
    whole sequence) at c = 2 (d = 2) and 4, and at c = 2 with its experts over e = 2 ranks at every sharding
    level and under ZB-H1 at p = 2; GPT on packed documents at c = 2 (d = 2) and 4; bf16 (d = 2) and fp16
    (p = 2) against c = 1; PipeDream and 2BW against the emulator."""
    references = [emulated(case) for case in ASYNC_CASES]
    results = run_distributed(4, other_families_and_compositions, [initial for initial, _, _ in references],
                              timeout=600)
    assert len(results[0][0]) == 13
    for index, (case, (_, expected_losses, expected_final)) in enumerate(zip(ASYNC_CASES, references)):
        check_case(case, [checked[index] for _, checked in results], expected_losses, expected_final)
