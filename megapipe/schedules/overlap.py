"""Which pass's expert all-to-all runs while the other pass computes, inside an overlapped pair.

An overlapped pair (``&B`` in the lists: DualPipeV's F & B, 1F1B's steady state with
``--overlap-moe-expert-parallel-comm``) runs the forward of one microbatch and the backward of
another together. Each pass is a chain of *segments* that alternate between computing and
communicating, one round per MoE layer (DualPipe's split of a layer):

* forward: attention (everything up to the dispatch: embedding, attention, router, permutation),
  dispatch (the tokens' all-to-all), experts, combine (the outputs' all-to-all), attention (the
  rest of the layer and the next layer's attention) ... ;
* backward: attention (from the output gradient down to the last MoE layer's combine),
  combine, experts, dispatch, attention ... (the same layers in reverse).

``PAIR`` says how the two chains interleave: the backward leads and the forward follows one
segment behind, so slot k runs backward segment k with forward segment k - 1, always one
all-to-all against the other pass's compute. Per MoE layer the slots read (DualPipe's order, as
the DeepSeek-V3 report draws it): forward attention | backward combine, forward dispatch |
backward experts, forward experts | backward dispatch, forward combine | backward attention. The
pair starts with the backward's first attention segment alone and ends with the forward's last
one alone. A pass with fewer segments (a chunk with fewer MoE layers)
leaves the other to run the rest alone. The executor's gate (``parallel/comm_overlap.py``) and
the simulator's charge (``analysis/simulate.py``'s ``overlapped_pair_time``) both read this one plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Action, ActionKind, Schedule


class Segment(str, Enum):
    """One piece of a pass through an MoE layer; DISPATCH and COMBINE are the all-to-alls."""

    ATTENTION = "attention"
    DISPATCH = "dispatch"
    EXPERTS = "experts"
    COMBINE = "combine"

    @property
    def communicates(self) -> bool:
        return self in (Segment.DISPATCH, Segment.COMBINE)


FORWARD_SEGMENTS = (Segment.ATTENTION, Segment.DISPATCH, Segment.EXPERTS, Segment.COMBINE)
BACKWARD_SEGMENTS = (Segment.ATTENTION, Segment.COMBINE, Segment.EXPERTS, Segment.DISPATCH)


@dataclass(frozen=True)
class PairPlan:
    """How an overlapped pair's two chains of segments interleave: ``lead`` runs its segment k in slot k,
    the other pass its segment k in slot k + ``lag`` (an odd lag puts a compute against an all-to-all)."""

    lead: ActionKind = ActionKind.B
    lag: int = 1

    def slot_of(self, backward: bool, segment: int) -> int:
        """The slot in which a pass runs its ``segment``-th segment."""
        follows = backward == (self.lead is ActionKind.F)
        return segment + (self.lag if follows else 0)

    def slots(self, moe_layers_forward: int, moe_layers_backward: int) -> list[tuple]:
        """Per slot, (forward segment, backward segment), None where a pass runs nothing: the table a pair
        of passes through these many MoE layers follows."""
        chains = [_chain(FORWARD_SEGMENTS, moe_layers_forward), _chain(BACKWARD_SEGMENTS, moe_layers_backward)]
        table: dict[int, list] = {}
        for backward, chain in enumerate(chains):
            for k, segment in enumerate(chain):
                table.setdefault(self.slot_of(bool(backward), k), [None, None])[backward] = segment
        return [tuple(table.get(slot, (None, None))) for slot in range(max(table) + 1)]


PAIR = PairPlan()


def _chain(order: tuple[Segment, ...], moe_layers: int) -> list[Segment]:
    """A pass's segments through ``moe_layers`` MoE layers: attention, then per layer three more, the last
    one's combine followed by the attention segment that finishes the pass."""
    return [order[0]] + [order[(k % 4)] for k in range(1, 4 * moe_layers + 1)]


def with_overlapped_pairs(schedule: Schedule) -> Schedule:
    """The compute-only ``schedule`` with every backward that its rank runs just before a forward of another
    microbatch moved after that forward and overlapped with it (``B i, F j`` becomes ``F j & B i``), as
    Megatron's combined 1F1B does: 1F1B's steady state becomes pairs, each rank running one more forward
    ahead (one more microbatch's activations held), so that no pair waits for its own forward's consumer.
    A schedule that has pairs of its own (DualPipeV) keeps exactly those. Lower the result
    (``lower_schedule``) to place the receives; it may deadlock (then it has no pairs to overlap)."""
    if overlapped_pairs(schedule):
        return schedule
    lists = []
    for actions in schedule.actions:
        reordered, i = [], 0
        while i < len(actions):
            action, following = actions[i], actions[i + 1] if i + 1 < len(actions) else None
            if (action.kind.makes_input_grad and following is not None and following.kind is ActionKind.F
                    and following.microbatch != action.microbatch):
                reordered += [following, Action(action.kind, action.stage, action.microbatch, version=action.version,
                                                overlapped=True)]
                i += 2
                continue
            reordered.append(action)
            i += 1
        lists.append(reordered)
    return schedule.with_actions(lists)


def overlapped_pairs(schedule: Schedule) -> int:
    """How many overlapped backwards the lists hold."""
    return sum(action.overlapped for actions in schedule.actions for action in actions)


def check_overlap_flags(expert: int, dispatcher: Optional[str] = None) -> None:
    """``--overlap-moe-expert-parallel-comm``'s refusals of the other flags, one sentence each (``dispatcher``
    None: not known to the caller; the allgather dispatcher marks no segments, so its passes would only
    run one after the other)."""
    if expert < 2:
        raise ConfigError("--overlap-moe-expert-parallel-comm hides the experts' all-to-all, which needs "
                          f"--expert-model-parallel-size of at least 2 (got {expert}); raise it or drop the flag.")
    if dispatcher not in (None, "alltoall"):
        raise ConfigError(f"--overlap-moe-expert-parallel-comm overlaps the all-to-all dispatcher's exchanges, not "
                          f"--moe-token-dispatcher-type {dispatcher}'s; use alltoall or drop the flag.")

