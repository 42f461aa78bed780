"""``ParallelState``'s axis table: every axis's size, rank and group come from one row (``AXES``), and a state
built by hand without an axis's group reads its fallback axis's group, or holds the axis alone."""

from __future__ import annotations

import pytest

from megapipe.layout.ranks import RankLayout
from megapipe.parallel.state import AXES, ParallelState

pytestmark = pytest.mark.unit

TENSOR, DATA = object(), object()  # stand-ins for process groups: the queries only hand them on


def rank_five() -> ParallelState:
    """Rank 5 of t = 2, d = 2, p = 2 (tensor innermost), built by hand with no context or expert groups."""
    members = {"tensor": [4, 5], "data": [5, 7], "pipeline": [1, 5], "model_parallel": [0, 1, 4, 5]}
    groups = {"tensor": TENSOR, "data": DATA, "pipeline": None, "model_parallel": None}
    return ParallelState(RankLayout(2, 2, 2), 5, groups=groups, members=members)


def test_each_axis_reads_its_own_group():
    ps = rank_five()
    assert (ps.tp_size, ps.tp_rank, ps.tp_group) == (2, 1, TENSOR)
    assert (ps.dp_size, ps.dp_rank, ps.dp_group) == (2, 0, DATA)
    assert (ps.pp_size, ps.pp_rank) == (2, 1)


def test_a_missing_axis_falls_back_or_stands_alone():
    ps = rank_five()
    assert (ps.cp_size, ps.cp_rank, ps.cp_group) == (1, 0, None)  # no context group: the rank alone
    assert (ps.ep_size, ps.ep_rank, ps.ep_group) == (1, 0, None)
    assert (ps.etp_size, ps.etp_rank, ps.etp_group) == (2, 1, TENSOR)  # experts split like the dense layers
    assert (ps.expert_dp_size, ps.expert_dp_group) == (2, DATA)
    assert (ps.dp_cp_size, ps.dp_cp_rank, ps.dp_cp_group) == (2, 0, DATA)


@pytest.mark.parametrize("prefix", sorted(AXES))
def test_every_axis_answers_three_queries(prefix):
    ps = ParallelState.single()
    assert (getattr(ps, f"{prefix}_size"), getattr(ps, f"{prefix}_rank"), getattr(ps, f"{prefix}_group")) == \
        (1, 0, None)
