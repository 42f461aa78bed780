"""A user error under ``megapipe-run`` (torchrun with megapipe's report) ends the job with its one sentence and
exit status 2, nothing else; any other failure keeps torchrun's full report (``megapipe.launcher``). Under
plain torchrun the sentence reaches torchrun's own report, as docs/training.md says, and nothing megapipe
installs runs in other interpreters.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import site
import subprocess
import sys

import pytest

from megapipe.launcher.usage_errors import KIND, usage_error_messages
from tests.launch_helpers import REPO

MEGAPIPE_RUN = [sys.executable, "-m", "megapipe.launcher.run"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
BAD_LAYOUT = ("error: world size 2 is not divisible by --tensor-model-parallel-size 3 x "
              "--pipeline-model-parallel-size 1; launch a multiple of 3 processes.")


def run_torchrun(*argv: str, launcher=MEGAPIPE_RUN, seconds: float = 120) -> subprocess.CompletedProcess:
    """``launcher`` on two processes; its process group is killed at the end."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.Popen([*launcher, "--nproc-per-node", "2", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=seconds)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.system
def test_a_bad_flag_under_megapipe_run_prints_its_sentence_once_and_exits_2():
    launcher = [shutil.which("megapipe-run")] if shutil.which("megapipe-run") else MEGAPIPE_RUN  # as installed
    result = run_torchrun("pretrain_gpt.py", "--tensor-model-parallel-size", "3", launcher=launcher)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", BAD_LAYOUT + "\n")


@pytest.mark.system
def test_plain_torchrun_prints_the_sentence_in_its_own_report_as_the_docs_say():
    result = run_torchrun("pretrain_gpt.py", "--tensor-model-parallel-size", "3", launcher=TORCHRUN)
    sentence = BAD_LAYOUT.removeprefix("error: ")
    assert result.returncode == 1 and result.stdout == ""
    assert f"traceback : {sentence}" in result.stderr and "failed (exitcode: 2)" in result.stderr
    assert result.stderr.count(BAD_LAYOUT) == 1  # one worker printed it, the other left it to the report
    training = (pathlib.Path(REPO) / "docs" / "training.md").read_text()
    assert "plain `torchrun` prints the sentence once, then its own report" in training


@pytest.mark.system
def test_a_generation_tool_under_megapipe_run_reports_like_training(tmp_path):
    result = run_torchrun("tools/generate.py", "--load", str(tmp_path / "none"), "--prompt", "The")
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"error: checkpoint directory {tmp_path / 'none'} does not exist.\n")


@pytest.mark.system
def test_a_crash_under_megapipe_run_keeps_torchruns_report(tmp_path):
    script = tmp_path / "crash.py"
    # one rank crashes (the other exits 0), so its traceback is not interleaved with a second one
    script.write_text("import os\nif os.environ['RANK'] == '0':\n    raise RuntimeError('crash on rank 0')\n")
    result = run_torchrun(str(script))
    assert result.returncode == 1
    assert "RuntimeError: crash on rank" in result.stderr
    assert "failed (exitcode: 1)" in result.stderr and "ChildFailedError" in result.stderr


class _Failure:
    """The two fields of torchrun's ``ProcessFailure`` that decide (its constructor reads files)."""

    def __init__(self, exitcode: int, message=None):
        self.exitcode = exitcode
        self.error_file_data = {} if message is None else {
            "message": {"message": message, "extraInfo": {"kind": KIND, "timestamp": "0"}}}


@pytest.mark.unit
def test_only_user_errors_and_torchruns_sigterms_count_as_a_user_error():
    sigterm = -signal.SIGTERM
    assert usage_error_messages({1: _Failure(2, "b."), 0: _Failure(2, "a."), 2: _Failure(2, "a."),
                                 3: _Failure(sigterm)}) == ["a.", "b."]
    assert usage_error_messages({0: _Failure(2)}) == []  # argparse's exit 2: the worker printed it
    for others in (_Failure(1), _Failure(-signal.SIGKILL), _Failure(-signal.SIGSEGV)):
        assert usage_error_messages({0: _Failure(2, "a."), 1: others}) is None
    assert usage_error_messages({0: _Failure(sigterm)}) is None


@pytest.mark.unit
def test_nothing_of_megapipe_runs_at_the_start_of_other_interpreters():
    """No ``.pth`` line in any site directory imports megapipe (setuptools' own finder of an editable
    install aside), and install.sh writes none."""
    for directory in {*site.getsitepackages(), site.getusersitepackages()}:
        for pth in pathlib.Path(directory).glob("*.pth") if os.path.isdir(directory) else ():
            for line in pth.read_text(errors="replace").splitlines():
                assert not (line.startswith("import") and "megapipe" in line and "__editable__" not in line), pth
    install = (pathlib.Path(REPO) / "install.sh").read_text()
    assert "site_hook" not in install and "megapipe_torchrun.pth" in install  # only removes an earlier one
