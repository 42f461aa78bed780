"""A user error under torchrun ends the job with its one sentence and exit status 2, nothing else;
any other failure keeps torchrun's full report (``megapipe.launcher``).

torchrun runs as its console script does, with megapipe's hook installed the way ``install.sh``
installs it: the ``.pth`` line ``site_hook`` writes, read from a site directory of the test's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from megapipe.launcher.site_hook import install
from megapipe.launcher.torchrun_hook import is_torchrun
from megapipe.launcher.usage_errors import KIND, usage_error_messages
from tests.launch_helpers import REPO

TORCHRUN = ("import site, sys; sys.argv[0] = 'torchrun'; site.addsitedir(sys.argv.pop(1)); "
            "from torch.distributed.run import main; sys.exit(main())")


def run_torchrun(site_dir, *argv: str, seconds: float = 120) -> subprocess.CompletedProcess:
    """torchrun's console script with ``site_dir`` as a site directory; its process group is killed at the end."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", TORCHRUN, str(site_dir), "--nproc-per-node", "2", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=seconds)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("site-packages")
    install(directory)
    return directory


@pytest.mark.system
def test_a_bad_flag_under_torchrun_prints_its_sentence_once_and_exits_2(site_dir):
    result = run_torchrun(site_dir, "pretrain_gpt.py", "--tensor-model-parallel-size", "3")
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", "error: world size 2 is not divisible by --tensor-model-parallel-size 3 x "
               "--pipeline-model-parallel-size 1; launch a multiple of 3 processes.\n")


@pytest.mark.system
def test_a_generation_tool_under_torchrun_reports_like_training(site_dir, tmp_path):
    result = run_torchrun(site_dir, "tools/generate.py", "--load", str(tmp_path / "none"), "--prompt", "The")
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"error: checkpoint directory {tmp_path / 'none'} does not exist.\n")


@pytest.mark.system
def test_a_crash_under_torchrun_keeps_torchruns_report(site_dir, tmp_path):
    script = tmp_path / "crash.py"
    # one rank crashes (the other exits 0), so its traceback is not interleaved with a second one
    script.write_text("import os\nif os.environ['RANK'] == '0':\n    raise RuntimeError('crash on rank 0')\n")
    result = run_torchrun(site_dir, str(script))
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
def test_the_hook_recognises_torchrun_and_nothing_else():
    assert is_torchrun(["/env/bin/torchrun", "--nproc-per-node", "2"], [])
    assert is_torchrun(["-m"], ["python", "-m", "torch.distributed.run", "x.py"])
    assert not is_torchrun(["-m"], ["python", "-m", "pytest"])
    assert not is_torchrun(["pretrain_gpt.py"], ["python", "pretrain_gpt.py"])
