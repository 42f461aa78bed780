"""pretrain_gpt.py with the experts split over 2 expert ranks, composed with 2 expert-data-parallel replicas
(sharded weights, recomputation), with tensor and sequence parallelism, at t = 2 with whole experts (expert-tensor
size 1, sharded weights), with pipeline parallelism under 1F1B, ZB-H1, ZBV and DualPipeV (the zero-bubble ones
with the experts' weight gradients left for BW; DualPipeV also with --overlap-moe-expert-parallel-comm), and with a
stage plan of unequal stages (--pipeline-stages; each stage's experts split over its 2 replicas, or over its 2
context ranks), logs the
single process's losses (1e-5, no capacity); so does an fp16 run, whose loss scaling skips steps alike on every
expert rank.
One single-process run is the reference for every layout."""

import pytest
from test_moe_expert_checkpoint import MOE
from test_training_cli import TINY, losses, run

pytestmark = pytest.mark.system

# DualPipeV needs 2 chunks on each of 2 pipeline ranks and 3 microbatches per replica
FOUR_LAYERS = MOE + ["--num-layers", "4", "--global-batch-size", "16"]
LAYOUTS = {  # on 4 processes; d = 4 / (t x p)
    "d4-e2-sharded-recompute": ["--data-parallel-sharding-strategy", "optim_grads_params",  # 2 copies of an expert
                                "--recompute-granularity", "full", "--recompute-method", "uniform",
                                "--recompute-num-layers", "1"],
    "t2-e2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "t2-e2-etp1-sharded": ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",  # whole
                           "--data-parallel-sharding-strategy", "optim_grads_params"],  # experts, d = 2
    "p2-e2-1f1b": ["--pipeline-model-parallel-size", "2"],
    "p2-e2-zb-h1": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
    "p2-e2-zbv": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                  "--num-layers-per-virtual-pipeline-stage", "1"],
    "p2-e2-dualpipev": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev",
                        "--num-layers-per-virtual-pipeline-stage", "1"],
    "p2-e2-dualpipev-overlap": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev",
                                "--num-layers-per-virtual-pipeline-stage", "1", "--overlap-moe-expert-parallel-comm"],
}


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    """The single process's losses of the four-layer model."""
    reference = run(TINY + FOUR_LAYERS, cache=tmp_path_factory.mktemp("reference"))
    assert reference.returncode == 0, reference.stderr
    values = losses(reference.stdout)
    assert len(values) == 6
    return values


def _assert_logs(expected, flags, tmp_path, name):
    result = run(TINY + FOUR_LAYERS + flags + ["--expert-model-parallel-size", "2"], nproc=4, cache=tmp_path)
    assert result.returncode == 0, (name, result.stderr)
    for i, value in losses(result.stdout).items():
        assert value == pytest.approx(expected[i], rel=1e-5), (name, i, value, expected[i])
    assert len(losses(result.stdout)) == 6, name


@pytest.mark.parametrize("name", LAYOUTS)
def test_expert_parallel_layouts_log_the_single_process_losses(expected, tmp_path, name):
    _assert_logs(expected, LAYOUTS[name], tmp_path, name)


def test_a_stage_plan_splits_each_stages_experts_over_its_own_ranks(expected, tmp_path):
    """Stages of 1 and 3 layers (--pipeline-stages): each stage's MoE layers split their experts over its own 2
    replicas, or, with each sequence split over 2 context ranks, over those."""
    _assert_logs(expected, ["--pipeline-stages", "0:1x2,1:4x2"], tmp_path, "plan")
    _assert_logs(expected, ["--pipeline-stages", "0:1,1:4", "--context-parallel-size", "2"], tmp_path, "plan-c2")


def test_fp16_at_two_expert_ranks_logs_the_single_process_losses(tmp_path):
    runs = [run(TINY + MOE + ["--fp16"] + flags, nproc=nproc, cache=tmp_path)
            for flags, nproc in (([], None), (["--expert-model-parallel-size", "2"], 2))]
    for result in runs:
        assert result.returncode == 0, result.stderr
    expected, got = (losses(result.stdout) for result in runs)
    assert len(got) == 6
    for i, value in got.items():
        assert value == pytest.approx(expected[i], rel=1e-5), (i, value, expected[i])
