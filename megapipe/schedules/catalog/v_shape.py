"""V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024):
schedules on the V placement built by repeating one *building block*.

The block gives, per rank r, the unit time slots at which microbatch 0 runs its four passes
that others wait for: F of chunk 0 (stage r), F of chunk 1 (stage 2p-1-r), BI of chunk 1 and BI
of chunk 0. Microbatch i repeats it 6i later (with F = BI = BW = 1 a rank has six passes per
microbatch, so the steady state leaves no slot empty). A rank's activations live from a
forward to its BW, so the block's lifespan on a rank sets its peak memory: the paper's
blocks keep chunk 0's activations about 4p slots (V-Min) and 6p slots (V-Half), so about
2p/3 and p chunk activations live at once (one new every 6 slots), a third and a half of
1F1B's 2p (p whole ranks' worth), plus a constant. Exactly, in whole ranks' worth of
activations (two chunk activations): V-Min holds floor((p + 4) / 3) and V-Half
floor(p / 2) + 1 at the most, against 1F1B's p.

From the block to lists, as the paper does: the BWs go into the empty slots, oldest BI
first (the rest after the last pass); then the warm-up and cool-down are *squeezed*: taking
passes in time order, each moves to the earliest empty slot after its inputs are ready if
that keeps every rank within the block's peak memory. Each rank's passes in time order are
its list; the replay (``replay.py``) then runs them as soon as inputs allow.
"""

from __future__ import annotations

from collections import deque

from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog.descriptor import SIMULATE, ScheduleDescriptor, v_sizes
from megapipe.schedules.catalog.zbv import check_v_microbatches
from megapipe.layout.placement import Placement, check_placement, stages_of_rank

PERIOD = 6  # slots per microbatch and rank: F, BI and BW of two chunks
F_DOWN, F_UP, BI_UP, BI_DOWN = range(4)  # the four passes of a block, chunk 0 going down the ranks


def v_min(p: int, m: int, v: int) -> list[list[Action]]:
    check_placement(Placement.V, v, "v-min")
    check_v_microbatches("v-min", p, m, 1)
    gap = 2 if p % 3 == 0 else 0  # keeps the four passes of a rank in distinct slots modulo 6
    block = [(r, 2 * p - 1 - r, 2 * p + gap + r, 4 * p + gap - 1 - r) for r in range(p)]
    return _from_block(p, m, block)


def v_half(p: int, m: int, v: int) -> list[list[Action]]:
    check_placement(Placement.V, v, "v-half")
    check_v_microbatches("v-half", p, m, 1)
    gap = 3 if p % 2 == 0 else 0
    block = [(2 * r, 3 * p - 2 - r, 3 * p + gap - 1 + 2 * r, 6 * p + gap - 2 - r) for r in range(p)]
    return _from_block(p, m, block)


def _from_block(p: int, m: int, block: list[tuple[int, ...]]) -> list[list[Action]]:
    slots = [{(kind, i): block[r][kind] + PERIOD * i for kind in range(4) for i in range(m)} for r in range(p)]
    cap = max(_peak(rank_slots) for rank_slots in slots)
    for _, rank, pass_ in sorted((slot, r, pass_) for r in range(p) for pass_, slot in slots[r].items()):
        _squeeze(p, slots, rank, pass_, cap)
    return [_actions(p, rank, rank_slots) for rank, rank_slots in enumerate(slots)]


def _inputs(p: int, rank: int, pass_: tuple[int, int]) -> list[tuple[int, tuple[int, int]]]:
    """(rank, pass) that ``pass_`` of ``rank`` waits for: its producer, its forward, the previous microbatch's."""
    kind, i = pass_
    last = rank == p - 1
    producer = {F_DOWN: (rank - 1, (F_DOWN, i)) if rank else None,
                F_UP: (rank, (F_DOWN, i)) if last else (rank + 1, (F_UP, i)),
                BI_UP: (rank - 1, (BI_UP, i)) if rank else (rank, (F_UP, i)),
                BI_DOWN: (rank, (BI_UP, i)) if last else (rank + 1, (BI_DOWN, i))}[kind]
    waits = [producer] if producer else []
    if kind in (BI_UP, BI_DOWN):
        waits.append((rank, (F_UP if kind == BI_UP else F_DOWN, i)))
    if i:
        waits.append((rank, (kind, i - 1)))
    return waits


def _squeeze(p: int, slots: list[dict], rank: int, pass_: tuple[int, int], cap: int) -> None:
    """Move ``pass_`` to the earliest empty slot after its inputs that keeps ``rank`` within ``cap``."""
    current = slots[rank][pass_]
    ready = max((slots[r][q] + 1 for r, q in _inputs(p, rank, pass_)), default=0)
    taken = set(slots[rank].values())
    for slot in range(ready, current):
        if slot in taken:
            continue
        slots[rank][pass_] = slot
        if _peak(slots[rank]) <= cap:
            return
    slots[rank][pass_] = current


def _with_weights(rank_slots: dict) -> list[tuple[int, int]]:
    """A rank's passes in slot order with each BW (kind -1 - chunk of its BI, microbatch) in the first
    empty slot after its BI, oldest first."""
    by_slot = {slot: pass_ for pass_, slot in rank_slots.items()}
    pending: deque[tuple[int, int]] = deque()
    order, slot = [], 0
    while len(order) < len(by_slot) * 3 // 2:  # every BI has its BW
        pass_ = by_slot.get(slot)
        if pass_ is not None:
            order.append(pass_)
            if pass_[0] in (BI_UP, BI_DOWN):
                pending.append((-1 - pass_[0], pass_[1]))
        elif pending:
            order.append(pending.popleft())
        slot += 1
    return order


def _peak(rank_slots: dict) -> int:
    """The most chunk activations the rank holds (from a forward to its BW)."""
    held = peak = 0
    for kind, _ in _with_weights(rank_slots):
        held += 1 if kind in (F_DOWN, F_UP) else -1 if kind < 0 else 0
        peak = max(peak, held)
    return peak


def _actions(p: int, rank: int, rank_slots: dict) -> list[Action]:
    down, up = stages_of_rank(Placement.V, p, 2, rank)
    stage = {F_DOWN: down, F_UP: up, BI_UP: up, BI_DOWN: down, -1 - BI_UP: up, -1 - BI_DOWN: down}
    kind_of = {F_DOWN: ActionKind.F, F_UP: ActionKind.F, BI_UP: ActionKind.BI, BI_DOWN: ActionKind.BI}
    return [Action(kind_of.get(kind, ActionKind.BW), stage[kind], i) for kind, i in _with_weights(rank_slots)] + [
        Action(ActionKind.STEP)]


# Not planned: their end bubble has no closed form (the simulator gives it per p).
V_HALF = ScheduleDescriptor(
    "v-half", v_half, "a building block repeated every 6 units on the V, about half 1F1B's activations",
    placement=Placement.V, sizes=v_sizes(), split_backward=True, costs=SIMULATE)
V_MIN = ScheduleDescriptor(
    "v-min", v_min, "a building block repeated every 6 units on the V, about a third of 1F1B's activations",
    placement=Placement.V, sizes=v_sizes(), split_backward=True, costs=SIMULATE)
