"""tools/plan.py end to end: the table, the torchrun command, the plan file the training scripts read
(uniform and PipeDream's uneven stages with replication), the plot, and one-sentence errors."""

import importlib.util
import json
from pathlib import Path

import pytest

from megapipe.layout.stage_plan import read_stage_plan
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.profile import ModelShape
from launch_helpers import REPO

ROOT = Path(REPO)


def load_tool():
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = load_tool()


def run(argv, capsys):
    code = TOOL.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_cluster(path, **overrides):
    cluster = {"nodes": 1, "gpus_per_node": 4, "memory_per_gpu": 2 ** 30, "intra_node_bandwidth": 2e10,
               "inter_node_bandwidth": 2e9, "achieved_flops": 1e12, **overrides}
    path.write_text(json.dumps(cluster))
    return path


@pytest.mark.system
def test_uniform_plan_file_command_and_plot(tmp_path, capsys):
    plan_path, plot_path = tmp_path / "plan.json", tmp_path / "plan.png"
    code, out, _ = run(["--model", "gpt-1.3b", "--cluster", "v100-16gb-8x8", "--global-batch-size", 512, "--top", 3,
                        "--plan-out", plan_path, "--plot-out", plot_path], capsys)
    assert code == 0
    plan = json.loads(plan_path.read_text())
    assert plan["command"] in out
    assert plan["command"].startswith("torchrun --nnodes 8 --nproc_per_node 8 ")
    t, p, d, b = (plan[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                     "data_parallel_size", "micro_batch_size"))
    assert t * p * d == 64
    untied = plan["schedule"] in ("2bw", "pipedream") and p > 1  # no flush keeps tied copies equal
    assert ("--untie-embeddings-and-output-weights" in plan["command"]) == untied
    for flag, value in (("--tensor-model-parallel-size", t), ("--pipeline-model-parallel-size", p),
                        ("--micro-batch-size", b), ("--global-batch-size", 512),
                        ("--pipeline-schedule", plan["schedule"]), ("--num-layers", 24)):
        assert f"{flag} {value} " in plan["command"] + " "
    assert plan["schedule"] != "interleaved"  # interleaved plans list model chunks instead of stages
    layers = [stage["layers"] for stage in plan["stages"]]
    assert len(layers) == p and all(stage["replicas"] == d for stage in plan["stages"])
    assert plan["pipeline_stages"] == ",".join(f"{a}:{b}x{d}" for a, b in layers)
    stage_plan = read_stage_plan(str(plan_path))  # what --pipeline-stages reads
    stage_plan.validate(24, world_size=64, tensor=t)
    assert stage_plan.layer_ranges == [tuple(pair) for pair in layers]
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.count("\n") > 5 and "samples/s" in out


@pytest.mark.system
def test_pipedream_plan_has_uneven_replicated_stages(tmp_path, capsys):
    # A 50k vocabulary: the tied embedding is costly to synchronise, the head costly to compute.
    cluster = write_cluster(tmp_path / "four.json", memory_per_gpu=4 * 2 ** 30, intra_node_bandwidth=1e9)
    plan_path = tmp_path / "pipedream.json"
    code, out, _ = run(["--num-layers", 8, "--hidden-size", 256, "--num-attention-heads", 4, "--seq-length", 128,
                        "--vocab-size", 50000, "--cluster", cluster, "--pipedream", "--micro-batch-size", 2,
                        "--plan-out", plan_path], capsys)
    assert code == 0
    plan = json.loads(plan_path.read_text())
    replicas = [stage["replicas"] for stage in plan["stages"]]
    assert sum(replicas) == 4 and len(set(replicas)) > 1
    assert plan["noam"] == -(-4 // replicas[0])
    assert plan["schedule"] == "pipedream"
    flag = ",".join(f"{s['layers'][0]}:{s['layers'][1]}x{s['replicas']}" for s in plan["stages"])
    assert f"--pipeline-stages {flag} " in plan["command"] and plan["pipeline_stages"] == flag
    assert plan["command"].startswith("torchrun --nnodes 1 --nproc_per_node 4 ")
    stage_plan = read_stage_plan(str(plan_path))
    stage_plan.validate(8, world_size=4)
    assert stage_plan.replicas == tuple(replicas)


@pytest.mark.unit
def test_an_interleaved_plan_lists_model_chunks_and_runs_by_its_command(tmp_path, capsys):
    plan_path = tmp_path / "interleaved.json"
    code, _, _ = run(["--model", "gpt-1.3b", "--cluster", "a100-80gb-1x8", "--global-batch-size", 64,
                      "--schedules", "interleaved", "--plan-out", plan_path], capsys)
    assert code == 0
    plan = json.loads(plan_path.read_text())
    p, per = plan["pipeline_model_parallel_size"], plan["num_layers_per_virtual_pipeline_stage"]
    assert "stages" not in plan and f"--num-layers-per-virtual-pipeline-stage {per}" in plan["command"]
    chunks = plan["model_chunks"]
    assert [c["layers"] for c in chunks] == [[k * per, (k + 1) * per] for k in range(24 // per)]
    assert [c["rank"] for c in chunks] == [k % p for k in range(len(chunks))]


@pytest.mark.unit
def test_a_cluster_with_zero_gpus_is_one_sentence(tmp_path, capsys):
    cluster = write_cluster(tmp_path / "empty.json", gpus_per_node=0)
    code, _, err = run(["--model", "gpt-1.3b", "--cluster", cluster, "--global-batch-size", 8], capsys)
    assert code == 2
    assert err == "error: cluster empty has gpus_per_node 0; it must be a whole number of at least 1.\n"


@pytest.mark.unit
def test_a_profile_of_another_model_is_refused(tmp_path, capsys):
    profile = tmp_path / "small.json"
    analytic_gpt_profile(ModelShape("gpt", 4, 64, 4, 32, 128, 256), 1e12).save(profile)
    code, _, err = run(["--profile", profile, "--num-layers", 8, "--hidden-size", 64, "--num-attention-heads", 4,
                        "--seq-length", 32, "--vocab-size", 128, "--cluster", write_cluster(tmp_path / "c.json"),
                        "--global-batch-size", 8], capsys)
    assert code == 2
    assert "was measured for a model with num_layers 4, but the model to plan has num_layers 8" in err
    assert err.count("\n") == 1


@pytest.mark.unit
@pytest.mark.parametrize("argv,message", [
    (["--global-batch-size", 8], "no model given"),
    (["--model", "gpt-1.3b"], "--global-batch-size is required"),
    (["--model", "gpt-9b", "--global-batch-size", 8], "model preset 'gpt-9b' is unknown"),
])
def test_missing_inputs_are_named(argv, message, tmp_path, capsys):
    code, _, err = run(argv + ["--cluster", write_cluster(tmp_path / "c.json")], capsys)
    assert code == 2 and message in err


@pytest.mark.unit
def test_an_asynchronous_best_plan_says_its_weights_are_stale_and_shows_the_best_synchronous_one(capsys):
    common = ["--model", "gpt-1.3b", "--cluster", "a100-80gb-1x8", "--global-batch-size", 64, "--top", 1]
    code, out, _ = run(common + ["--schedules", "2bw,1f1b"], capsys)
    lines = out.splitlines()
    assert code == 0 and ", 2bw, " in next(line for line in lines if line.startswith("best: "))
    assert "gradients are computed on weights one or more updates old (stale weights)" in out
    synchronous = next(line for line in lines if line.startswith("best synchronous: "))
    _, alone, _ = run(common + ["--schedules", "1f1b"], capsys)  # the synchronous search on its own
    best_alone = next(line for line in alone.splitlines() if line.startswith("best: "))
    layout_and_speed = lambda line, prefix: line.removeprefix(prefix).split(" samples/s")[0]  # noqa: E731
    assert layout_and_speed(synchronous, "best synchronous: ") == layout_and_speed(best_alone, "best: ")
    assert "stale weights" not in alone
