"""Stage plans (--pipeline-stages / the planner's JSON), their rank layout and process groups."""

import json

import pytest

from megapipe.errors import ConfigError
from megapipe.parallel.state import ParallelState
from megapipe.layout.ranks import RankLayout
from megapipe.layout.plan import PlanLayout
from megapipe.layout.stage_plan import PlannedStage, StagePlan, read_stage_plan

pytestmark = pytest.mark.unit


def test_flag_and_json_forms_read_the_same_plan(tmp_path):
    plan = StagePlan.parse("0:12x2,12:24")
    assert plan.stages == (PlannedStage(0, 12, 2), PlannedStage(12, 24, 1))
    assert (plan.replicas, plan.workers, plan.num_stages, plan.equal_replication) == ((2, 1), 3, 2, None)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"stages": [{"layers": [0, 12], "replicas": 2}, {"layers": [12, 24], "replicas": 1}]}))
    assert read_stage_plan(str(path)) == plan == StagePlan.from_json(plan.to_json())
    assert read_stage_plan(plan.to_text()) == plan
    plan.validate(24, world_size=6, tensor=2)


@pytest.mark.parametrize("text, layers, world, message", [
    ("0:12y2", 24, None, "entry '0:12y2' is not start:end or start:endxR"),
    ("0:12x0,12:24", 24, None, "gives layers 0:12 0 replicas"),
    ("5:5,5:24", 24, None, "stage 5:5 holds no layers"),
    ("0:10,12:24", 24, None, "leaves layers 10..11 unassigned"),
    ("0:12,10:24", 24, None, "gives layers 10..11 to two stages"),
    ("0:12,12:20", 24, None, "leaves layers 20..23 unassigned"),
    ("0:12,12:30", 24, None, "names layers up to 29, but --num-layers is 24"),
    ("1:12,12:24", 24, None, "leaves layers 0..0 unassigned"),
    ("0:12x2,12:24x1", 24, 4, "replicas add up to 3 workers x --tensor-model-parallel-size 1 = 3 processes, but "
                              "the world has 4"),
])
def test_bad_plans_are_named_with_the_fix(text, layers, world, message):
    with pytest.raises(ConfigError, match=message):
        StagePlan.parse(text).validate(layers, world)


def test_bad_plan_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_stage_plan(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text('{"stages": [{"replicas": 2}]}')
    with pytest.raises(ConfigError, match="is not a stage plan"):
        read_stage_plan(str(broken))


@pytest.mark.parametrize("tensor, stages, copies, context, hierarchical", [
    (1, 2, 2, 1, None), (2, 3, 2, 1, None), (2, 2, 1, 1, None), (1, 4, 3, 1, None), (2, 2, 2, 2, None),
    (1, 2, 1, 4, (2, 2))])
def test_equal_replication_is_the_parallel_pipelines_grid(tensor, stages, copies, context, hierarchical):
    plan = StagePlan.parse(",".join(f"{s}:{s + 1}x{copies}" for s in range(stages)))
    layout = PlanLayout(plan, tensor, context=context, hierarchical=hierarchical)
    grid = RankLayout(tensor, stages, copies, context=context, hierarchical=hierarchical)
    assert layout.world_size == grid.world_size
    for name in ("tensor_groups", "data_groups", "pipeline_groups", "model_parallel_groups", "embedding_groups",
                 "context_groups", "data_context_groups", "context_a2a_groups", "context_ring_groups"):
        assert sorted(getattr(layout, name)()) == sorted(getattr(grid, name)()), name
    assert layout.degrees().text() == grid.degrees().text()


def test_two_one_layout_with_tensor_parallelism():
    # Workers 0, 1 replicate stage 0 and worker 2 holds stage 1; each worker is two tensor ranks.
    layout = PlanLayout(StagePlan.parse("0:2x2,2:4x1"), tensor=2)
    assert layout.world_size == 6
    assert layout.tensor_groups() == [[0, 1], [2, 3], [4, 5]]
    assert layout.data_groups() == [[0, 2], [1, 3], [4], [5]]
    assert layout.pipeline_groups() == [[0, 2, 4], [1, 3, 5]]


def test_two_one_layout_with_context_parallelism():
    # Each worker is 2 context ranks; 1F1B-RR's pipeline groups hold every worker's rank of one context index.
    layout = PlanLayout(StagePlan.parse("0:2x2,2:4x1"), context=2)
    assert layout.world_size == 6
    assert layout.context_groups() == [[0, 1], [2, 3], [4, 5]]
    assert layout.data_groups() == [[0, 2], [1, 3], [4], [5]]
    assert layout.data_context_groups() == [[0, 1, 2, 3], [4, 5]]
    assert layout.pipeline_groups() == [[0, 2, 4], [1, 3, 5]]
    assert layout.loss_rank() == 4


def test_views_answer_the_same_queries():
    # A 2-1 state as ParallelState.initialize(plan=...) builds it (rank 4: tensor rank 0 of the stage-1 worker).
    members = {"tensor": [4, 5], "data": [4], "pipeline": [0, 2, 4], "model_parallel": list(range(6)),
               "embedding": []}
    ps = ParallelState(PlanLayout(StagePlan.parse("0:2x2,2:4x1"), 2), 4, groups={k: None for k in members},
                       members=members, stage_replicas=(2, 1))
    assert (ps.tp_size, ps.tp_rank, ps.pp_size, ps.pp_rank, ps.dp_size) == (2, 0, 3, 2, 1)
    assert (ps.pipeline_stage, ps.is_first_stage, ps.is_last_stage) == (1, False, True)
    stage = ps.stage_view()
    assert (stage.pp_size, stage.tp_size, stage.dp_size, stage.members["model_parallel"]) == (1, 2, 1, [4, 5])
