"""PipeDream: 1F1B(-RR) without flushes, an update after every backward, weight stashing
(seed 002 sections 2.4.2-2.4.3; Table 7.1).

Every stage applies each microbatch's gradient as soon as its backward is done (``UPDATE``),
so version k of a stage is its weights after k updates. Weight stashing: a forward uses the
stage's latest version and its backward the same one. In a straight pipeline stage s
(0-indexed) then computes microbatch t's gradient on version t - (p - 1 - s), which is Table
7.1's update W(t+1) = W(t) - lr grad f(W_1(t-p+1), ..., W_p(t)), and holds p - s versions.

Vertical sync (optional): microbatch t is tagged with the version its forward sees at the
input stage, and every stage uses that version for both passes: W_s(t-p+1) on all stages.
The schedule is static, so the tag is known when the lists are made: it is the version of
every stage's F and B of microbatch t (and of the messages that carry t between stages);
stages keep the older versions later forwards name.

A replicated stage (1F1B-RR) all-reduces the gradients of one microbatch per replica before
each update, as data parallelism would: its update k applies microbatches kR .. kR + R - 1.
"""

from __future__ import annotations

from typing import Optional

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog.descriptor import (ClosedForms, ScheduleDescriptor, Sizes, no_bubble,
                                                       rank_warmup_in_flight, steady_time)
from megapipe.schedules.weight_policy import WeightPolicy
from megapipe.schedules.catalog.round_robin import check_batch_fits_replicas, one_f_one_b_round_robin


def pipedream(*, p: int, m: int, v: int, batches: int, replicas: Optional[tuple[int, ...]],
              vertical_sync: bool) -> list[list[Action]]:
    """Registered without chunks: the registry refuses v > 1 before calling it."""
    replicas = replicas or (1,) * p
    check_batch_fits_replicas("pipedream", replicas, m)
    if vertical_sync and len(set(replicas)) > 1:
        raise ConfigError(f"--pipedream-vertical-sync needs every stage to update at the same rate, but the stage "
                          f"replicas {list(replicas)} differ, so a version number means a different number of "
                          "updates on each stage; drop the flag or replicate every stage equally.")
    order = one_f_one_b_round_robin(replicas, m * batches)
    tags = _input_stage_versions(order[:replicas[0]]) if vertical_sync else None
    return [_stash(actions, replicas, tags) for actions in order]


def _input_stage_versions(input_workers: list[list[Action]]) -> dict[int, int]:
    """Per microbatch, the version its forward sees at the input stage (updates so far on that replica)."""
    tags = {}
    for actions in input_workers:
        updates = 0
        for action in actions:
            if action.kind is ActionKind.F:
                tags[action.microbatch] = updates
            else:
                updates += 1
    return tags


def _stash(actions: list[Action], replicas: tuple[int, ...], tags: Optional[dict[int, int]]) -> list[Action]:
    """Tag F and B with their version and follow every B with its stage's UPDATE."""
    out, versions, updates = [], {}, 0
    for action in actions:
        stage, microbatch = action.stage, action.microbatch
        if action.kind is ActionKind.F:
            versions[microbatch] = tags[microbatch] if tags is not None else updates
            out.append(Action(ActionKind.F, stage, microbatch, version=versions[microbatch]))
            continue
        count = replicas[stage]
        out += [Action(ActionKind.B, stage, microbatch, version=versions.pop(microbatch)),
                Action(ActionKind.UPDATE, stage, microbatch - microbatch % count + count - 1)]
        updates += 1
    return out


# Seed 002 Table 7.1: bubble 0, (weight versions, activation stashes) = (p, p), per rank p - r of
# each. Planned with one microbatch per batch: PipeDream updates the weights after every
# microbatch, so a batch is one microbatch per pipeline.
DESCRIPTOR = ScheduleDescriptor(
    "pipedream", pipedream, "1F1B(-RR) without flushes, an update after every backward, weight stashing",
    weight_policy=WeightPolicy.STASH, unequal_replicas=True, vertical_sync=True,
    costs=ClosedForms(in_flight=rank_warmup_in_flight, bubble=no_bubble, batch_time=steady_time, exact=False,
                      sizes=Sizes(most_microbatches=1)))
