"""Process groups: membership, ordering and the embedding group, for worlds of 1, 2, 4 and 8.

The expected groups are built independently of ``RankLayout``: ranks are enumerated in
nested-loop order (pipeline outermost, tensor innermost) and grouped by the coordinates
that must be equal.
"""

import itertools

import pytest
import torch.distributed as dist

from megapipe.errors import ConfigError
from megapipe.parallel.state import ParallelState
from megapipe.layout.ranks import RankLayout
from megapipe.testing.worlds import run_distributed


def splits(world: int):
    """Every (t, p, d) with t * p * d == world."""
    return [(t, p, world // (t * p)) for t in range(1, world + 1) for p in range(1, world + 1)
            if world % (t * p) == 0]


def expected_groups(t: int, p: int, d: int) -> dict:
    coords = {rank: c for rank, c in enumerate(itertools.product(range(p), range(d), range(t)))}  # (p, d, t)

    def group_by(keep):
        groups = {}
        for rank, (pi, di, ti) in coords.items():
            groups.setdefault(keep(pi, di, ti), []).append(rank)
        return sorted(groups.values())

    pipeline = group_by(lambda pi, di, ti: (di, ti))
    return {
        "tensor": group_by(lambda pi, di, ti: (pi, di)),
        "data": group_by(lambda pi, di, ti: (pi, ti)),
        "pipeline": pipeline,
        "model_parallel": group_by(lambda pi, di, ti: di),
        "embedding": sorted({tuple(sorted({g[0], g[-1]})) for g in pipeline}),
    }


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_rank_layout_groups(world):
    for t, p, d in splits(world):
        layout = RankLayout.for_world(world, t, p)
        expected = expected_groups(t, p, d)
        assert sorted(layout.tensor_groups()) == expected["tensor"]
        assert sorted(layout.data_groups()) == expected["data"]
        assert sorted(layout.pipeline_groups()) == expected["pipeline"]
        assert sorted(layout.model_parallel_groups()) == expected["model_parallel"]
        assert sorted({tuple(g) for g in layout.embedding_groups()}) == expected["embedding"]
        for group in layout.tensor_groups():  # tensor-innermost: a tensor group is consecutive ranks
            assert group == list(range(group[0], group[0] + t))
        for group in layout.pipeline_groups():  # ordered by stage
            assert [layout.coords(r)[2] for r in group] == list(range(p))


def check_built_groups(rank, world_size):
    seen = []
    for t, p, d in splits(world_size):
        ps = ParallelState.initialize(tensor=t, pipeline=p)
        expected = expected_groups(t, p, d)
        for name in ("tensor", "data", "pipeline", "model_parallel", "embedding"):
            mine = [g for g in expected[name] if rank in g]
            if name == "embedding" and not mine:  # a middle stage holds no embedding
                assert ps.groups[name] is None
                continue
            assert len(mine) == 1, (name, mine)
            ranks = dist.get_process_group_ranks(ps.groups[name])
            assert list(ranks) == list(mine[0]), (t, p, d, name, ranks, mine)
        pipeline = expected_groups(t, p, d)["pipeline"]
        my_pipe = next(g for g in pipeline if rank in g)
        stage = my_pipe.index(rank)
        assert (ps.pp_rank, ps.is_first_stage, ps.is_last_stage) == (stage, stage == 0, stage == p - 1)
        assert ps.next_rank == my_pipe[(stage + 1) % p] and ps.prev_rank == my_pipe[(stage - 1) % p]
        assert ps.in_embedding_group == (stage in (0, p - 1))
        # the groups work: a sum over the tensor group counts its members
        x = __import__("torch").ones(1)
        dist.all_reduce(x, group=ps.tp_group)
        assert int(x.item()) == t
        seen.append((t, p, d))
    return seen


@pytest.mark.parametrize("world", [2, 4, 8])
def test_built_groups_in_a_real_world(world):
    results = run_distributed(world, check_built_groups, timeout=240)
    assert all(r == splits(world) for r in results)


def test_single_process_state():
    ps = ParallelState.single()
    assert (ps.tp_size, ps.pp_size, ps.dp_size, ps.is_first_stage, ps.is_last_stage) == (1, 1, 1, True, True)


def test_world_size_mismatch_is_one_sentence():
    with pytest.raises(ConfigError, match="world size 6 does not equal tensor 2 x pipeline 2 x data 2"):
        RankLayout.for_world(6, 2, 2, 2)
    with pytest.raises(ConfigError, match="world size 6 is not divisible by --tensor-model-parallel-size 4"):
        RankLayout.for_world(6, 4, 1)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 0 must be at least 1"):
        RankLayout.for_world(4, 1, 0)
