"""Saves killed with SIGKILL at random moments never cost the previous checkpoint (crash consistency).

``save_loop_gpt.py`` is a process that loads the latest checkpoint, checks its weights, and then
only saves, one checkpoint after another, each with weights of its own. It is killed after a
random delay (seeded; most of its time is spent saving, so the moment falls anywhere in a save:
writing shards, syncing, publishing, moving the pointer) and started again, ``KILLS`` times,
with synchronous and with asynchronous (``--async-save``) saves. After every kill the pointer
``latest_checkpointed_iteration.txt`` must name a complete checkpoint whose tensors are exactly the
weights saved at that iteration, read offline, and the next incarnation must load it through the
real loader and save past the killed save's leftovers; a last incarnation saves once and exits,
leaving no leftovers behind. ``MEGAPIPE_CRASH_SEED`` draws other kill moments (to hunt; the suite
runs the default).
"""

import os
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from launch_helpers import REPO, Job
from megapipe.checkpointing import paths
from megapipe.checkpointing.offline import read_checkpoint

pytestmark = [pytest.mark.system, pytest.mark.timeout(400)]

KILLS = 8
KILL_WITHIN_SECONDS = 0.5  # the loop saves a checkpoint every few hundredths of a second
START_SECONDS = 120


def _incarnation(root: str, flags: list[str]) -> Job:
    """``save_loop_gpt.py`` forked from a server that has imported torch: it starts in a fraction of a second."""
    return Job([sys.executable, os.path.join(REPO, "tests", "save_loop_gpt.py"), root, *flags], forked=True)


def _check_pointer(root: str) -> int:
    """The iteration ``latest`` names (0: none yet), once its checkpoint is read whole and holds that
    iteration's weights."""
    latest = paths.read_latest(root)
    if latest is None:  # killed in the first save
        return 0
    directory, common, tensors = read_checkpoint(root)
    assert directory == paths.iteration_dir(root, latest) and common.iteration == latest
    weights = [tensor for key, tensor in tensors.items() if key.startswith("model/")]
    assert weights
    for tensor in weights:  # save_loop_gpt.pattern: every element of a weight is iteration + index / 1000
        assert torch.all(tensor == tensor.flatten()[0]) and int(tensor.flatten()[0]) == latest
    return latest


def _forget_older(root: str, latest: int) -> None:
    """Delete published checkpoints older than ``latest`` (disk space); leftovers of killed saves stay."""
    for name in os.listdir(root):
        if name.startswith("iter_") and name[5:].isdigit() and int(name[5:]) < latest:
            shutil.rmtree(os.path.join(root, name))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_saves_killed_at_random_moments_keep_the_previous_checkpoint(tmp_path, mode):
    rng = random.Random(f"checkpoint-kills-{mode}-{os.environ.get('MEGAPIPE_CRASH_SEED', 0)}")
    root = str(tmp_path / "ckpt")
    flags = ["--async-save"] if mode == "async" else []
    latest, in_a_save = 0, 0
    for _ in range(KILLS):
        job = _incarnation(root, flags)
        try:
            assert job.wait_for(r"^loaded \d+", START_SECONDS) == f"loaded {latest}\n"
            job.wait_for(r"^saving \d+", START_SECONDS)
            with pytest.raises(subprocess.TimeoutExpired):  # the random variable: when the loop is cut
                job.proc.wait(timeout=rng.uniform(0, KILL_WITHIN_SECONDS))
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.finish(30)
        finally:
            job.close()
        in_a_save += job.lines[-1].startswith("saving")
        assert job.proc.returncode == -signal.SIGKILL, job.output()[-3000:]
        before, latest = latest, _check_pointer(root)
        assert latest >= before  # the pointer never goes back
        _forget_older(root, latest)
    job = _incarnation(root, flags + ["--saves", "1"])
    try:
        assert job.wait_for(r"^loaded \d+", START_SECONDS) == f"loaded {latest}\n"
        assert job.finish(START_SECONDS) == 0, job.output()[-3000:]
    finally:
        job.close()
    assert _check_pointer(root) == latest + 1
    leftovers = [name for name in os.listdir(root) if not (name == paths.LATEST or name.startswith("iter_")
                                                            and name[5:].isdigit())]
    assert leftovers == []
    print(f"{mode}: {KILLS} kills, {in_a_save} while a save was in flight, 0 checkpoints unloadable")
