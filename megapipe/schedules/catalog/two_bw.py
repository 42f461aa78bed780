"""PipeDream-2BW: 1F1B without flushes, gradients accumulated over batches of m microbatches,
double-buffered weights (seed 002 section 3.2.1, Fig 3.2; Table 7.1).

Each stage applies the gradients of batch j (microbatches jm .. jm + m - 1) with one UPDATE
after its last backward of that batch, creating version j + 1. Microbatch k (1-indexed) uses
version max(floor((k-1)/m) - 1, 0) for both passes (seed 002 L2306), i.e. batch j uses version
max(j - 1, 0): W(t+1) = W(t) - lr grad f(W(t-1)). With m >= p the version a forward needs
always exists, and a stage never needs more than two versions.

Interleaving (v chunks per rank, Megatron's order with no flush) is well defined when every
chunk has applied batch j - 1 before its first forward of batch j + 1; the extra warm-up of
interleaving runs forwards further ahead, which m >= 2p always allows (m = p suffices only
for p <= 2). Other sizes raise a ConfigError naming the first chunk that would lack its
version. Replicated stages must all have the same replication (parallel pipelines, seed 002
section 3.2.3).
"""

from __future__ import annotations

from typing import Optional

from megapipe.errors import ConfigError
from megapipe.schedules.actions import Action, ActionKind
from megapipe.schedules.catalog.descriptor import (ClosedForms, ScheduleDescriptor, Sizes, no_bubble,
                                                       rank_warmup_in_flight, steady_time)
from megapipe.schedules.weight_policy import WeightPolicy
from megapipe.schedules.catalog.interleaved import interleaved
from megapipe.schedules.catalog.round_robin import check_batch_fits_replicas, one_f_one_b_round_robin


def two_bw_version(microbatch: int, m: int) -> int:
    """The weight version 0-indexed microbatch ``microbatch`` uses: max(floor((k-1)/m) - 1, 0), k = microbatch + 1."""
    return max(microbatch // m - 1, 0)


def two_bw(*, p: int, m: int, v: int, batches: int, replicas: Optional[tuple[int, ...]],
           vertical_sync: bool) -> list[list[Action]]:
    if vertical_sync:
        raise ConfigError("--pipedream-vertical-sync has no meaning with --pipeline-schedule 2bw, where every stage "
                          "already uses one version per microbatch; drop the flag.")
    replicas = replicas or (1,) * p
    if len(set(replicas)) > 1:
        raise ConfigError(f"--pipeline-schedule 2bw needs equally replicated stages (parallel pipelines), but the "
                          f"stage replicas are {list(replicas)}; replicate every stage equally or use "
                          "--pipeline-schedule pipedream.")
    check_batch_fits_replicas("2bw", replicas, m)
    stages, copies = len(replicas), replicas[0]
    if m < stages * copies:
        per_replica = "" if copies == 1 else f" per replica (m / {copies})"
        raise ConfigError(f"--pipeline-schedule 2bw needs at least as many microbatches per batch{per_replica} as "
                          f"pipeline stages, but m={m} gives fewer than {stages}; raise --global-batch-size or lower "
                          "--micro-batch-size.")
    if v > 1:
        if m % p:
            raise ConfigError(f"--pipeline-schedule 2bw with --virtual-pipeline-model-parallel-size {v} needs m={m} "
                              f"to be a multiple of --pipeline-model-parallel-size {p}.")
        order = [actions[:-1] for actions in interleaved(p, m * batches, v)]  # drop the flush STEP
    else:
        order = one_f_one_b_round_robin(replicas, m * batches)
    lists = [_double_buffer(actions, m) for actions in order]
    _check_versions_exist(lists, p, m, v)
    return lists


def _double_buffer(actions: list[Action], m: int) -> list[Action]:
    """Tag F and B with the 2BW version and add an UPDATE after each chunk's last backward of a batch."""
    last_of_batch = {}
    for action in actions:
        if action.kind is ActionKind.B:
            last_of_batch[(action.stage, action.microbatch // m)] = action.microbatch
    out = []
    for action in actions:
        out.append(Action(action.kind, action.stage, action.microbatch, version=two_bw_version(action.microbatch, m)))
        batch = action.microbatch // m
        if action.kind is ActionKind.B and last_of_batch[(action.stage, batch)] == action.microbatch:
            out.append(Action(ActionKind.UPDATE, action.stage, (batch + 1) * m - 1))
    return out


def _check_versions_exist(lists: list[list[Action]], p: int, m: int, v: int) -> None:
    for rank, actions in enumerate(lists):
        updates: dict[int, int] = {}
        for action in actions:
            if action.kind is ActionKind.UPDATE:
                updates[action.stage] = updates.get(action.stage, 0) + 1
            elif action.kind is ActionKind.F and action.version > updates.get(action.stage, 0):
                raise ConfigError(
                    f"--pipeline-schedule 2bw is not well defined for p={p}, v={v}, m={m}: stage {action.stage} on "
                    f"rank {rank} would run the forward of microbatch {action.microbatch} before applying the batch "
                    f"that creates its version {action.version}, because interleaving runs forwards far ahead; use "
                    f"m >= {2 * p} (a multiple of p) or no interleaving.")


def _least_microbatches(p: int, v: int) -> int:
    """m >= p; interleaved, m >= 2p unless p <= 2 (the versions a forward needs must exist)."""
    return p if v == 1 or p <= 2 else 2 * p


def _microbatch_step(p: int, m: int, v: int) -> int:
    return p if v > 1 else 1


# Seed 002 Table 7.1: bubble 0, (weight versions, activation stashes) = (2, p): p - r in flight on
# rank r, as 1F1B. Planned with one chunk per rank.
DESCRIPTOR = ScheduleDescriptor(
    "2bw", two_bw, "1F1B without flushes, gradients accumulated over a batch, double-buffered weights",
    sizes=Sizes(most_chunks=None, least_microbatches=_least_microbatches, microbatch_step=_microbatch_step),
    weight_policy=WeightPolicy.DOUBLE_BUFFER,
    costs=ClosedForms(in_flight=rank_warmup_in_flight, bubble=no_bubble, batch_time=steady_time, exact=False,
                      sizes=Sizes(least_microbatches=lambda p, v: p)))
