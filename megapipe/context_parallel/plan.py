"""Which fused-kernel calls one block of context-parallel attention needs, decided from the global
positions of its tokens (host integers, so no device synchronisation).

A side of a block holds tokens whose positions are a few contiguous ranges, in storage order (a
rank's two chunks, a gathered sequence put back in order). Under causal attention, the keys of a
range wholly before a query range are all visible (one call, no mask), keys wholly after it are
skipped, and a key range over the query range's own positions needs the causal mask (the kernel's
own when both sides hold exactly the same positions in increasing order). Adjacent visible key
pieces are one call; query ranges with the same visible keys are one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Ranges = tuple[tuple[int, int], ...]


def ranges_of(positions: Sequence[int]) -> Ranges:
    """``positions`` as maximal runs of consecutive integers, [start, end) each, in order."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, p + 1])
    return tuple((a, b) for a, b in runs)


def length(ranges: Ranges) -> int:
    return sum(end - start for start, end in ranges)


@dataclass(frozen=True)
class Call:
    """One kernel call: query rows ``q`` and key rows ``k`` ([start, end) in storage order)."""
    q: tuple[int, int]
    k: tuple[int, int]
    causal: bool = False    # the causal mask applies inside this call
    diagonal: bool = False  # ... and both sides hold the same increasing positions (kernel's own mask)


def _increasing(ranges: Ranges) -> bool:
    return all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))


def _pieces(q_range: tuple[int, int], k: Ranges) -> list[Call]:
    """The calls of the queries at positions ``q_range`` (rows 0 .. n, shifted later) against ``k``."""
    qs, qe = q_range
    rows = (0, qe - qs)
    pieces: list[Call] = []
    offset = 0
    for ks, ke in k:
        before = min(ke, qs)
        if ks < before:
            if pieces and not pieces[-1].causal and pieces[-1].k[1] == offset:
                pieces[-1] = Call(rows, (pieces[-1].k[0], offset + before - ks))
            else:
                pieces.append(Call(rows, (offset, offset + before - ks)))
        lo, hi = max(ks, qs), min(ke, qe)
        if lo < hi:
            pieces.append(Call(rows, (offset + lo - ks, offset + hi - ks), causal=True,
                               diagonal=(lo, hi) == (qs, qe)))
        offset += ke - ks
    return pieces


def block_calls(q: Ranges, k: Ranges, causal: bool) -> list[Call]:
    """The kernel calls of queries at positions ``q`` against keys at positions ``k``; none for a
    block no query may see (it is skipped)."""
    sq, sk = length(q), length(k)
    if not causal:
        return [Call((0, sq), (0, sk))]
    if q == k and _increasing(q):
        return [Call((0, sq), (0, sk), causal=True, diagonal=True)]
    calls: list[Call] = []
    offset = 0
    previous: list[Call] = []
    for qs, qe in q:
        pieces = _pieces((qs, qe), k)
        if pieces and [p.k for p in pieces] == [p.k for p in previous] and not any(p.causal for p in pieces + previous):
            start = calls[-len(previous)].q[0]  # same visible keys as the range before: widen its calls
            calls[-len(previous):] = [Call((start, offset + qe - qs), p.k) for p in pieces]
        else:
            calls.extend(Call((offset, offset + qe - qs), p.k, p.causal, p.diagonal) for p in pieces)
        previous = pieces
        offset += qe - qs
    return calls
