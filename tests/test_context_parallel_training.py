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
"""

from __future__ import annotations

import pytest

from batch_helpers import packed_microbatch
from test_pipeline_training import (MICRO, SEQ, assert_matches_reference, optimizer_config, pipelined_run,
                                    reference_run)
from megapipe.optim import OptimizerConfig
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
LAYERS = 4  # the pipeline tests' model with 4 of its 8 layers: p = 2 with v = 2 still has one per chunk


def zero1() -> OptimizerConfig:
    return OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.9, weight_decay=0.0, clip_grad=0.0,
                           data_parallel_sharding_strategy="optim")


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
            out.append(dict(t=1, c=2, p=1, d=2, comm=comm, zero1=True))
    out += [dict(t=2, c=2, p=1, d=1, comm="p2p", sequence_parallel=True),
            dict(t=2, c=2, p=1, d=1, comm="all_gather", recompute=True),
            dict(t=1, c=2, p=2, d=1, comm="p2p", schedule="1f1b"),
            dict(t=1, c=2, p=2, d=1, comm="all_gather", schedule="interleaved", v=2)]
    if groups // 2 % 2 == 0:  # a2a under t = 2: the local query groups divide by c
        out.append(dict(t=2, c=2, p=1, d=1, comm="a2a"))
    return out


def check_family(rank, world_size, kind, layouts, packed_documents=False):
    batch = packed if packed_documents else None
    extra = dict(num_layers=LAYERS, **({"microbatch": batch} if batch else {}))
    references = {d: reference_run(kind, d, **extra) for d in sorted({case["d"] for case in layouts})}
    checked = []
    for case in layouts:
        context = dict(context=case["c"], cp_comm_type=case["comm"])
        if case["comm"] == "a2a+p2p":
            context["hierarchical_context"] = (2, case["c"] // 2)
        schedule, v = case.get("schedule", "1f1b"), case.get("v", 1)
        optimizer = zero1() if case.get("zero1") else optimizer_config()
        what = f"{kind} {case}"
        ps, losses, final = pipelined_run(kind, case["t"], case["p"], case["d"], schedule, v,
                                          references[case["d"]][0], recompute=case.get("recompute", False),
                                          context=context, optimizer=optimizer,
                                          sequence_parallel=case.get("sequence_parallel", False), **extra)
        assert ps.cp_size == case["c"]
        assert_matches_reference(ps, losses, final, references[case["d"]], what)
        checked.append(what)
    return checked


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_context_parallel_matches_single_process(kind):
    layouts = cases(kind)
    results = run_distributed(4, check_family, kind, layouts, timeout=600)
    assert len(results[0]) == len(layouts)


def bert_moe_and_packed_documents(rank, world_size):
    bert = check_family(rank, world_size, "bert", [dict(t=1, c=2, p=1, d=2, comm="p2p"),
                                                   dict(t=1, c=2, p=2, d=1, comm="all_gather")])
    moe = check_family(rank, world_size, "moe", [dict(t=1, c=2, p=1, d=2, comm="p2p"),
                                                 dict(t=1, c=4, p=1, d=1, comm="all_gather")])
    documents = check_family(rank, world_size, "gpt", [dict(t=1, c=2, p=1, d=2, comm="p2p"),
                                                       dict(t=1, c=4, p=1, d=1, comm="all_gather")],
                             packed_documents=True)
    return bert + moe + documents


def test_bert_moe_and_packed_documents_match_single_process():
    """BERT at c = 2 (with d = 2, and with p = 2); a mixture-of-experts Llama (both balancing losses over the
    whole sequence) and GPT on packed documents at c = 2 (d = 2) and 4."""
    assert len(run_distributed(4, bert_moe_and_packed_documents, timeout=600)[0]) == 6
