"""Attention of a rank's queries against one block of keys and values, forward and backward, through
the fused kernels: the unit that ring, all-gather and all-to-all attention all repeat.

A block knows the global positions of both sides (``plan.Ranges``) and, for packed documents or
padding, their labels: a query attends to a key only where the query's label equals the key's
(document ids; a padding key carries ``PADDING``, which no query has). Grouped-query attention:
k and v arrive with their query groups only; each kernel call repeats them for its query heads,
and their gradients are summed back over the heads of a group. Forward and backward accumulate
in fp32 into the caller's tensors.

With the whole sequence's document ids on the host (``documents``), a block runs one unmasked call
per piece of a document instead (``documents.py``). Otherwise a call that needs a mask (labels, or a
causal order the kernel's own mask cannot give) is split by
query rows so that no mask holds more than ``MASK_ELEMENTS`` entries (batch x rows x keys): the
kernels take masks as dense tensors, so a long block's mask would otherwise be as large as its
scores; split, it is bounded whatever the sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megapipe.context_parallel import kernels
from megapipe.context_parallel.documents import document_calls
from megapipe.context_parallel.merge import merge
from megapipe.context_parallel.plan import Call, Ranges, block_calls

PADDING = torch.iinfo(torch.int64).min  # the label of a padding key: no query's document
MASK_ELEMENTS = 1 << 24  # the most mask entries one kernel call is given (16 Mi: 32 MiB as a bf16 bias)


def positions(ranges: Ranges, device) -> torch.Tensor:
    return torch.cat([torch.arange(a, b, device=device) for a, b in ranges])


@dataclass(frozen=True)
class Block:
    """Queries at positions ``q`` against keys at ``k``, labels [b, n] per side or None, or instead the
    whole sequence's document ids [b, s] on the host."""
    q: Ranges
    k: Ranges
    causal: bool
    q_labels: torch.Tensor | None = None
    k_labels: torch.Tensor | None = None
    documents: torch.Tensor | None = None

    def calls(self, batch: int = 1) -> list[tuple[slice, Call]]:
        """(batch rows, call) of the kernel calls for ``batch`` sequences: per document piece with ``documents``,
        else a masked call split so its mask stays within MASK_ELEMENTS."""
        if self.documents is not None:
            return [(slice(row, row + 1), call) for row, call in document_calls(self.q, self.k, self.causal,
                                                                               self.documents)]
        calls = []
        for call in block_calls(self.q, self.k, self.causal):
            (q0, q1), (k0, k1) = call.q, call.k
            rows = max(1, MASK_ELEMENTS // (batch * (k1 - k0)))
            if not self._masked(call) or q1 - q0 <= rows:
                calls.append(call)
                continue
            calls.extend(Call((start, min(start + rows, q1)), call.k, call.causal)  # a part is no diagonal
                         for start in range(q0, q1, rows))
        return [(slice(None), call) for call in calls]

    def _masked(self, call: Call) -> bool:
        return self.q_labels is not None or (call.causal and not call.diagonal)

    def allowed(self, call: Call, device) -> torch.Tensor | None:
        """Bool [b or 1, 1, sq, sk] of the call, or None where the kernel needs no mask."""
        (q0, q1), (k0, k1) = call.q, call.k
        mask = None
        if self.q_labels is not None:
            mask = self.q_labels[:, q0:q1, None] == self.k_labels[:, None, k0:k1]
        if call.causal and (mask is not None or not call.diagonal):
            order = positions(self.k, device)[None, k0:k1] <= positions(self.q, device)[q0:q1, None]
            mask = order if mask is None else mask & order
        return None if mask is None else mask.unsqueeze(1)

    def kernel_causal(self, call: Call) -> bool:
        return call.diagonal and self.q_labels is None


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    n = heads // x.size(1)
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    b, heads, s, d = grad.shape
    return grad if heads == groups else grad.float().view(b, groups, heads // groups, s, d).sum(2)


def block_forward(q, k, v, block: Block, scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge this block into ``out`` [b, heads, sq, d] and ``lse`` [b, heads, sq] (fp32, in place)."""
    for b, call in block.calls(q.size(0)):
        (q0, q1), (k0, k1) = call.q, call.k
        o, l = kernels.forward(q[b, :, q0:q1], _repeat(k[b, :, k0:k1], q.size(1)), _repeat(v[b, :, k0:k1], q.size(1)),
                               causal=block.kernel_causal(call), allowed=block.allowed(call, q.device), scale=scale)
        out[b, :, q0:q1], lse[b, :, q0:q1] = merge(out[b, :, q0:q1], lse[b, :, q0:q1], o, l)


def block_backward(dout, q, k, v, out, lse, block: Block, scale: float, dq: torch.Tensor, dk: torch.Tensor,
                   dv: torch.Tensor) -> None:
    """Add this block's share of the gradients into ``dq``, ``dk``, ``dv`` (fp32, in place), from the
    whole attention's ``out`` (q's dtype) and ``lse``."""
    for b, call in block.calls(q.size(0)):
        (q0, q1), (k0, k1) = call.q, call.k
        gq, gk, gv = kernels.backward(dout[b, :, q0:q1], q[b, :, q0:q1], _repeat(k[b, :, k0:k1], q.size(1)),
                                      _repeat(v[b, :, k0:k1], q.size(1)), out[b, :, q0:q1], lse[b, :, q0:q1],
                                      causal=block.kernel_causal(call), allowed=block.allowed(call, q.device),
                                      scale=scale)
        dq[b, :, q0:q1] += gq
        dk[b, :, k0:k1] += _fold(gk, k.size(1))
        dv[b, :, k0:k1] += _fold(gv, v.size(1))


def accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (out, lse) accumulators for ``q``'s rows: zeros and -inf, fp32."""
    return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device))
