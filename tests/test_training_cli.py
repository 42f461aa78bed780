"""The training entry points, run as users run them: torchrun, and ``python pretrain_gpt.py`` (the script as
``__main__`` with its flags, mostly in a process forked from a server that has imported torch, which starts
seconds sooner than a new interpreter: ``megapipe.testing.forked``)."""

import os
import subprocess
import sys

import matplotlib.image
import pytest

from megapipe.schedules.analysis.timeline import Timeline
from megapipe.testing.forked import run_script
from megapipe.training.logger import losses_in_log
from launch_helpers import REPO as ROOT

pytestmark = pytest.mark.system

sys.path.insert(0, os.path.join(ROOT, "tools"))
import plot_schedule  # noqa: E402
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6", "--log-interval", "1",
        "--eval-interval", "100", "--eval-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "3e-3", "--lr-warmup-iters", "0"]


def run(args, nproc=None, timeout=300, env_extra=None, cache=None, script="pretrain_gpt.py", forked=True):
    """The script on ``nproc`` ranks under torchrun, or as one process: forked from a server that has imported
    torch (``megapipe.testing.forked``, torchrun's workers too: seconds less to start each), or with
    ``forked=False`` in new interpreters."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    if cache:
        env["MEGAPIPE_CACHE"] = str(cache)
    env.update(env_extra or {})
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    argv = launcher + [os.path.join(ROOT, script)] + args
    if forked:
        return run_script(argv, env, ROOT, timeout)
    return subprocess.run([sys.executable] + argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def losses(output: str, name: str = "lm loss") -> dict[int, float]:
    return losses_in_log(output, name)


@pytest.mark.parametrize("args,message", [
    (["--global-batch-size", "30", "--micro-batch-size", "4"],
     "--global-batch-size 30 is not divisible by --micro-batch-size 4"),
    (["--num-layers", "5", "--pipeline-model-parallel-size", "1", "--num-layers-per-virtual-pipeline-stage", "2"],
     "--num-layers 5 is not divisible by --pipeline-model-parallel-size 1 x --num-layers-per-virtual-pipeline-stage 2"),
    (["--fp16", "--bf16"], "--fp16"),
    (["--data-path", "does/not/exist"], "does/not/exist"),
    (["--data-path", "x", "--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file"),
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--pipedream-vertical-sync"], "--pipedream-vertical-sync has no meaning with --pipeline-schedule 1f1b"),
    (["--pipeline-schedule", "auto", "--schedule-forward-time", "1", "--schedule-memory-limit", "0.5"],
     "--schedule-memory-limit 0.5 is below one microbatch's activations per rank, which every schedule holds; "
     "the least value that works is 1."),
    (["--schedule-memory-limit", "3"], "read only by --pipeline-schedule auto"),
    (["--device-peak-tflops", "0"], "--device-peak-tflops 0 must be above 0"),
    (["--pipeline-schedule", "auto", "--schedule-profile", "none.json"], "profile none.json does not exist"),
])
def test_bad_flags_give_one_sentence_and_no_traceback(args, message, tmp_path):
    result = run(args, timeout=120, cache=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_torchrun_tensor_and_pipeline_equal_one_process(tmp_path):
    """(t, p) = (2, 2) on 4 processes gives the losses of one process (same seed, same global batch).

    The logs carry 7 significant digits; the runs differ only in fp32 summation order, so the
    losses agree to ~1e-6 relative: 1e-5 is the bound. The parallel run records its timeline
    (``--record-timeline``): every forward and backward of both pipeline ranks, which
    ``tools/plot_schedule.py --timeline`` draws.
    """
    single = run(TINY, cache=tmp_path)
    assert single.returncode == 0, single.stderr
    timeline = tmp_path / "run.timeline.json"
    parallel = run(TINY + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                           "--record-timeline", str(timeline)], nproc=4, cache=tmp_path)
    assert parallel.returncode == 0, parallel.stderr
    recorded = Timeline.load(timeline)
    assert recorded.meta == {"p": 2, "v": 1, "m": 4, "schedule": "1f1b"}
    for rank in (0, 1):  # 6 iterations of 4 microbatches
        kinds = [e.action.kind.name for e in recorded.events if e.rank == rank]
        assert (kinds.count("F"), kinds.count("B"), kinds.count("STEP")) == (24, 24, 6), kinds
    picture = tmp_path / "run.png"
    assert plot_schedule.main(["--timeline", str(timeline), "-o", str(picture)]) == 0
    assert matplotlib.image.imread(picture).shape[0] > 100
    expected, actual = losses(single.stdout), losses(parallel.stdout)
    assert sorted(expected) == list(range(1, 7)) and sorted(actual) == sorted(expected)
    for i in expected:
        assert actual[i] == pytest.approx(expected[i], rel=1e-5), (i, actual[i], expected[i])
    assert expected[6] < expected[1]  # and it learns


def test_bf16_trains_on_cpu(tmp_path):
    result = run(TINY + ["--bf16"], cache=tmp_path)
    assert result.returncode == 0, result.stderr
    values = losses(result.stdout)
    assert len(values) == 6 and values[6] < values[1]


def test_wandb_offline_and_tensorboard_receive_the_figures(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run(TINY + ["--wandb-project", "megapipe-test", "--wandb-save-dir", str(tmp_path / "wandb"),
                         "--tensorboard-dir", str(tmp_path / "tb")], cache=tmp_path,
                 env_extra={"WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/lm loss")]
    assert logged == pytest.approx(list(losses(result.stdout).values()), rel=1e-6)
    assert "train/tflops-per-device" in events.Tags()["scalars"]
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
