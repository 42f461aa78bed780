"""Expert parallelism's groups (Megatron-core's folding of each stage's ranks) and its refusals of bad degrees.

The expected groups are built independently of ``ExpertFold``: a stage's ranks are enumerated in
nested-loop order (expert-data outermost, expert-tensor innermost) and grouped by the coordinates
that must be equal.
"""

import itertools

import pytest

from megapipe.cli.parse import parse_config
from megapipe.errors import ConfigError
from megapipe.layout.plan import PlanLayout
from megapipe.layout.ranks import RankLayout
from megapipe.layout.stage_plan import StagePlan

pytestmark = pytest.mark.unit


def expected(t: int, p: int, d: int, e: int, etp: int) -> dict:
    edp = t * d // (etp * e)
    coords = {}
    for stage in range(p):
        for local, c in enumerate(itertools.product(range(edp), range(e), range(etp))):
            coords[stage * t * d + local] = (stage, *c)

    def group_by(keep):
        groups = {}
        for rank, (s, di, ei, ti) in coords.items():
            groups.setdefault(keep(s, di, ei, ti), []).append(rank)
        return sorted(groups.values())

    return {"expert": group_by(lambda s, di, ei, ti: (s, di, ti)),
            "expert_tensor": group_by(lambda s, di, ei, ti: (s, di, ei)),
            "expert_data": group_by(lambda s, di, ei, ti: (s, ei, ti))}


@pytest.mark.parametrize("t, p, d, e, etp", [(1, 1, 2, 2, None), (1, 1, 4, 2, None), (2, 1, 2, 2, None),
                                             (1, 2, 2, 2, None), (2, 2, 4, 4, None), (2, 1, 2, 4, 1),
                                             (1, 1, 4, 1, None), (2, 1, 2, 1, 1)])
def test_expert_groups_fold_each_stage_like_megatron_core(t, p, d, e, etp):
    layout = RankLayout.for_world(t * p * d, t, p, expert=e, expert_tensor=etp)
    want = expected(t, p, d, e, etp or t)
    assert sorted(layout.expert_groups()) == want["expert"]
    assert sorted(layout.expert_tensor_groups()) == want["expert_tensor"]
    assert sorted(layout.expert_data_groups()) == want["expert_data"]
    if etp is None:  # experts split the dense layers' data-parallel replicas: same tensor index and stage
        assert sorted(layout.expert_tensor_groups()) == sorted(layout.tensor_groups())
        for group in layout.expert_groups():
            assert len({layout.coords(r)[0] for r in group}) == 1 and len({layout.coords(r)[2] for r in group}) == 1
    assert layout.degrees().text().startswith(f"t {t}, c 1, e {e},")


@pytest.mark.parametrize("t, etp, e, replicas", [(1, None, 2, 2), (2, 1, 2, 2), (2, 1, 1, 2), (2, None, 2, 4)])
def test_a_stage_plan_folds_each_stage_as_equal_stages_do(t, etp, e, replicas):
    """Equally replicated stages of any sizes: the groups of ``RankLayout`` with as many stages."""
    plan = StagePlan.parse(f"0:1x{replicas},1:4x{replicas}")
    layout, grid = PlanLayout(plan, t, e, etp), RankLayout(t, 2, replicas, e, etp)
    for groups in ("expert_groups", "expert_tensor_groups", "expert_data_groups"):
        assert sorted(getattr(layout, groups)()) == sorted(getattr(grid, groups)()), groups


def test_unequal_stages_fold_their_own_ranks():
    """Whole experts below t at e = 1 (each stage's t / etp shares and its replicas hold the same experts)."""
    layout = PlanLayout(StagePlan.parse("0:2x2,2:4x1"), tensor=2, expert_tensor=1)
    assert sorted(layout.expert_data_groups()) == [[0, 1, 2, 3], [4, 5]]
    assert sorted(layout.expert_groups()) == [[rank] for rank in range(6)]
    assert sorted(layout.expert_tensor_groups()) == [[rank] for rank in range(6)]


def parsed(*flags: str, world: int = 2):
    return parse_config("gpt", ["--model-preset", "mixtral-tiny", *flags], world_size=world)


def test_expert_sizes_parse_into_the_parallel_config():
    config = parsed("--expert-model-parallel-size", "2", world=2)
    assert (config.parallel.expert, config.parallel.expert_tensor) == (2, None)


@pytest.mark.parametrize("flags, world, message", [
    (("--expert-model-parallel-size", "3"), 3, r"^--num-experts 8 is not divisible by --expert-model-parallel-size "
                                               r"3; every expert rank must hold the same number of experts\.$"),
    (("--expert-model-parallel-size", "4"), 2, r"^--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 "
                                               r"does not divide the 2 ranks of a pipeline stage"),
    (("--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"), 2,
     r"^--expert-model-parallel-size 2 x --expert-tensor-parallel-size 2 does not divide the 2 ranks"),
    (("--expert-model-parallel-size", "0"), 2, r"^--expert-model-parallel-size 0 must be at least 1\.$"),
    (("--expert-tensor-parallel-size", "3", "--tensor-model-parallel-size", "4"), 4,
     r"^--expert-tensor-parallel-size 3 does not divide --tensor-model-parallel-size 4: each group of that many "
     r"tensor ranks shares a tensor group's tokens between its experts; use a divisor of it\.$"),
    (("--pipeline-stages", "0:2x1,2:4x1", "--expert-model-parallel-size", "2"), 2,
     r"^--expert-model-parallel-size 2 x --expert-tensor-parallel-size 1 does not divide the 1 ranks of a pipeline "
     r"stage"),
    (("--pipeline-stages", "0:2x2,2:4x1", "--pipeline-schedule", "pipedream", "--expert-model-parallel-size", "2"), 3,
     r"^--pipeline-stages 0:2x2,2:4x1 replicates its stages unequally, and 1F1B-RR's replicas of a stage run "
     r"different microbatches at different times"),
])
def test_bad_expert_degrees_are_one_sentence(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        parsed(*flags, world=world)


def test_expert_parallelism_needs_experts():
    with pytest.raises(ConfigError, match=r"^--expert-model-parallel-size 2 needs --num-experts"):
        parse_config("gpt", ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
                             "--expert-model-parallel-size", "2"], world_size=2)
