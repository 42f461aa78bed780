"""A script forked from the preloaded server (``megapipe.testing.forked``) behaves as when run by a new
interpreter: its argv, the caller's environment and working directory, its output and errors apart,
Python's exit statuses, processes of its own; past its deadline it is killed with its process group."""

import os
import signal
import subprocess
import sys

import pytest

from megapipe.testing.forked import ForkedProcess, run_script

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

SCRIPT = """
import multiprocessing, os, sys, time

def square(x):
    return x * x

if __name__ == "__main__":
    print(sys.argv[1:], os.environ.get("FORKED_TEST"), os.getcwd())
    print("to stderr", file=sys.stderr)
    if sys.argv[1] == "pool":
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            print(sum(pool.map(square, range(4))))
    if sys.argv[1] == "hang":
        print(os.getpgid(0) == os.getpid(), flush=True)
        time.sleep(600)
    code = sys.argv[1]
    sys.exit(None if code == "pool" else int(code) if code.isdigit() else code)
"""


@pytest.fixture
def script(tmp_path, monkeypatch):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    monkeypatch.setenv("FORKED_TEST", "now")
    return str(path)


def test_argv_environment_directory_output_and_exit_statuses_are_the_scripts(script, tmp_path):
    env = dict(os.environ)
    done = run_script([script, "pool"], env, str(tmp_path), timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"['pool'] now {tmp_path}\n14\n", "to stderr\n")
    assert run_script([script, "a message"], env, str(tmp_path), timeout=60).stderr.endswith("a message\n")
    assert run_script([script, "a message"], env, str(tmp_path), timeout=60).returncode == 1


def test_a_script_runs_in_its_own_session_and_is_killed_with_it_past_its_deadline(script, tmp_path):
    hanging = ForkedProcess([script, "hang"], dict(os.environ), str(tmp_path))
    try:
        lines = [hanging.stdout.readline() for _ in range(3)]  # errors come merged with the output
        assert "True\n" in lines, lines  # its own process group, which kill() ends
    finally:
        hanging.kill()
    assert hanging.returncode == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        run_script([script, "hang"], dict(os.environ), str(tmp_path), timeout=3)


def test_exit_statuses_are_those_of_a_new_interpreter(script, tmp_path):
    direct = subprocess.run([sys.executable, script, "7"], capture_output=True, text=True, timeout=60)
    assert direct.returncode == run_script([script, "7"], dict(os.environ), str(tmp_path), timeout=60).returncode == 7



WORKER = """
import os, sys
# one write per line: two unbuffered workers' print() calls could interleave their pieces
sys.stdout.write(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} in {os.getcwd()} parent {os.getppid()}\\n")
sys.exit(3 if os.environ["RANK"] == sys.argv[1] else 0)
"""


def _parents(output: str) -> set:
    return {int(line.split()[-1]) for line in output.splitlines() if line.startswith("rank ")}


def test_a_forked_torchrun_forks_its_workers_from_the_server_unless_told_not_to(tmp_path):
    """torchrun's workers are the server's children, listed by rank in the pid folder; they write on
    torchrun's output (line by line, as with ``python -u``), and a worker's exit status ends the job as with
    new interpreters. With ``fork_workers=False`` they are torchrun's own children, as always."""
    from multiprocessing import forkserver

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = dict(os.environ, MEGAPIPE_WORKER_PIDS=str(pids))
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker)]
    done = run_script(command + ["none"], env, str(tmp_path), timeout=120, merge_errors=True)
    assert done.returncode == 0, done.stdout
    for rank in (0, 1):
        assert f"rank {rank} of 2 in {tmp_path} parent" in done.stdout
    assert _parents(done.stdout) == {forkserver._forkserver._forkserver_pid}
    assert sorted(os.listdir(pids)) == ["0", "1"]
    first = {int((pids / name).read_text()) for name in ("0", "1")}
    failed = run_script(command + ["1"], env, str(tmp_path), timeout=120, merge_errors=True)
    assert failed.returncode == 1 and "exitcode  : 3" in failed.stdout, failed.stdout
    second = {int((pids / name).read_text()) for name in ("0", "1")}
    assert first.isdisjoint(second)
    fresh = ForkedProcess(command + ["none"], env, str(tmp_path), fork_workers=False)
    output = fresh.stdout.read()
    assert fresh.wait(60) == 0 and _parents(output) == {fresh.pid}, output
    assert {int((pids / name).read_text()) for name in ("0", "1")} == second  # none listed: not forked


CLOSE_AFTER_EXIT = """
import os, sys
from megapipe.testing import forked
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

forked._fork_torchrun_workers(sys.argv[1], None)  # as in a forked torchrun
handler = SubprocessHandler(sys.executable, ("-c", "pass"), {**os.environ, "RANK": "0"}, None, None, 0, None)
handler.proc.wait(60)  # exited, and reaped by the server: its process group is gone
handler.close()  # what torchrun does to every worker whose exit it has not yet seen, once another fails
print("closed")
"""


def test_torchrun_closes_a_forked_worker_that_the_server_has_already_reaped(tmp_path):
    """A new interpreter stays a zombie, with its process group, until torchrun waits for it; a forked worker is
    the server's child and is reaped at once, so torchrun's ``killpg`` in ``close`` (after another worker
    failed) can find no group. That must not end torchrun with a traceback instead of the failure's report."""
    from megapipe.testing.forked import _server_address

    script = tmp_path / "close.py"
    script.write_text(CLOSE_AFTER_EXIT)
    done = run_script([str(script), _server_address()], dict(os.environ), str(tmp_path), timeout=60)
    assert (done.returncode, done.stdout) == (0, "closed\n"), done.stderr
