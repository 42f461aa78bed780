"""Context-parallel attention computes what one process computes over the whole sequence.

One world of 4 gloo processes runs every case: each comm type at c = 2 (two context groups of 2
ranks) and c = 4 (a2a+p2p as 2 x 2), causal and bidirectional, with grouped-query attention
(8 heads, 4 query groups), without a mask, with document ids (as local labels, and as the whole
sequence's ids on the host: one unmasked call per document piece) and with key padding. Each rank
compares its rows of the output and of the gradients of q, k and v with ``megapipe.fusions.attention``
over the whole sequence with the equivalent full mask.

Tolerance: fp32 within 1e-5 of the reference's largest magnitude. The same products are summed in
another order and each block's partial softmax is rescaled once by exp(lse_block - lse) per merge,
a few fp32 roundings (2^-24 each) per element, about 1e-7 relative; 1e-5 leaves room and still
catches any wrong mask (a missing or extra key changes outputs by ~1e-1). bf16 (inputs rounded to
bf16, reference in fp32 on the same inputs): each kernel output is an average of bf16 values and
is rounded to bf16 once per block, so the error is a few bf16 roundings (2^-8 relative); 2^-5.
"""

import pytest
import torch
import torch.distributed as dist

from megapipe.context_parallel import Timeline, context_attention
from megapipe.fusions.attention import attention
from megapipe.layout.context import local_positions
from megapipe.parallel.context import ContextGroups
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

B, HEADS, GROUPS, SEQ, DIM, SCALE = 2, 8, 4, 32, 8, 0.4
FP32, BF16 = 1e-5, 2 ** -5
CASES = [(comm, c, causal, mask) for comm, sizes in (("p2p", (2, 4)), ("all_gather", (2, 4)), ("a2a", (2, 4)),
                                                      ("a2a+p2p", (4,)))
         for c in sizes for causal in (True, False) for mask in (None, "documents", "host documents", "padding")]
BF16_CASES = [(comm, 4, True, mask) for comm in ("p2p", "all_gather", "a2a", "a2a+p2p")
              for mask in ("documents", "host documents")]


def make_groups(rank: int) -> dict:
    """Every context layout of the cases, built on every rank in the same order."""
    def group(ranks):
        made = dist.new_group(list(ranks))
        return made if rank in ranks else None

    pairs = [group((0, 1)), group((2, 3))]
    whole = group((0, 1, 2, 3))
    rings = [group((0, 2)), group((1, 3))]
    layouts = {}
    for comm in ("p2p", "all_gather", "a2a"):
        mine = (0, 1) if rank < 2 else (2, 3)
        layouts[comm, 2] = ContextGroups(pairs[rank // 2], mine, mine.index(rank), comm)
        layouts[comm, 4] = ContextGroups(whole, (0, 1, 2, 3), rank, comm)
    layouts["a2a+p2p", 4] = ContextGroups(whole, (0, 1, 2, 3), rank, "a2a+p2p", a2a_group=pairs[rank // 2],
                                          a2a_ranks=(0, 1) if rank < 2 else (2, 3), ring_group=rings[rank % 2],
                                          ring_ranks=(0, 2) if rank % 2 == 0 else (1, 3))
    return layouts


def whole_inputs(mask: str | None, dtype):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, n, SEQ, DIM, generator=g).to(dtype) for n in (HEADS, GROUPS, GROUPS))
    grad = torch.randn(B, HEADS, SEQ, DIM, generator=g).to(dtype)
    documents = padding = None
    if mask in ("documents", "host documents"):  # packed: documents of 5, 14 and 13 tokens, and one of 32
        documents = torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * SEQ])
    if mask == "padding":  # the last 11 keys of sequence 0, the first 3 of sequence 1 (rows that see none)
        padding = torch.zeros(B, SEQ, dtype=torch.bool)
        padding[0, -11:], padding[1, :3] = True, True
    return q, k, v, grad, documents, padding


def full_mask(documents, padding):
    if documents is not None:
        return (documents[:, :, None] != documents[:, None, :]).unsqueeze(1)
    if padding is not None:
        return padding[:, None, None, :].expand(B, 1, SEQ, SEQ)
    return None


def relative_errors(groups: ContextGroups, case, dtype) -> list[float]:
    _, c, causal, mask = case
    q, k, v, grad, documents, padding = whole_inputs(mask, dtype)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    want = attention(*leaves, full_mask(documents, padding), causal=causal, scale=SCALE)
    want_grads = torch.autograd.grad(want, leaves, grad.float())
    rows = torch.tensor(local_positions(SEQ, c, groups.index))
    local = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    got = context_attention(*local, groups, seq_length=SEQ, causal=causal, scale=SCALE,
                            key_padding=None if padding is None else padding[:, rows],
                            document_ids=None if documents is None else documents[:, rows],
                            sequence_documents=documents if mask == "host documents" else None)
    got_grads = torch.autograd.grad(got, local, grad[:, :, rows])
    return [((a.float() - b[:, :, rows]).abs().max() / b.abs().max()).item()
            for a, b in zip([got] + list(got_grads), [want] + list(want_grads))]


def run_cases(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    layouts = make_groups(rank)
    results = {("fp32",) + case: relative_errors(layouts[case[:2]], case, torch.float32) for case in CASES}
    results.update({("bf16",) + case: relative_errors(layouts[case[:2]], case, torch.bfloat16) for case in BF16_CASES})
    timeline = Timeline()
    q, k, v, grad, _, _ = whole_inputs(None, torch.float32)
    local = [t[:, :, :SEQ // 4].clone().requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, layouts["p2p", 4], seq_length=SEQ, causal=True, scale=SCALE, timeline=timeline)
    out.backward(grad[:, :, :SEQ // 4])
    results["timeline"] = timeline
    return results


@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_distributed(4, run_cases, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case)))
def test_fp32_equals_one_process(world, case):
    for rank, results in enumerate(world):
        errors = results[("fp32",) + case]
        assert max(errors) <= FP32, f"rank {rank}: out, dq, dk, dv relative errors {errors}"


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda case: "-".join(map(str, case)))
def test_bf16_within_bf16_rounding(world, case):
    for rank, results in enumerate(world):
        errors = results[("bf16",) + case]
        assert max(errors) <= BF16, f"rank {rank}: out, dq, dk, dv relative errors {errors}"


def test_ring_transfers_overlap_compute(world):
    """Each of the c - 1 forward transfers (and c - 1 backward ones that carry blocks) was posted before
    its step's compute began and waited after it ended."""
    for results in world:
        timeline = results["timeline"]
        assert timeline.overlapped("forward") == [True] * 3
        assert timeline.overlapped("backward") == [True] * 4
