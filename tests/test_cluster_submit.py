"""``tools/cluster.py submit`` of a job no registered worker type can hold: said at once, or refused with ``--strict``.

A quiet ``submit`` would print the job's id and exit 0, leaving the reason to ``status``. Here it
still prints the id and exits 0, and says on stderr, in one line, that the job waits and why (the
sentence ``status`` shows under it); with ``--strict`` the service refuses it (nothing journaled
or queued) and ``submit`` prints that one sentence and exits 2. One service in this process (no
round loop: nothing changes but what the requests change) behind the real HTTP server on a
loopback port, and the tool's ``main`` called in this process: the whole path, no process started.
"""

import pytest

from megapipe.lease.auth import SECRET_ENV, create_secret_file
from megapipe.cluster.service.http_api import serve
from megapipe.cluster.service.journal import Journal
from megapipe.cluster.service.service import ClusterService
from cluster_helpers import load_cluster_tool
from test_cluster_service_events import NEEDS_TWO, REFUSED, SMALL, WIDE

pytestmark = [pytest.mark.system, pytest.mark.timeout(60)]

TOOL = load_cluster_tool()


@pytest.fixture
def scheduler(tmp_path, monkeypatch):
    """The service with one worker of 1 fast and 1 slow device, and the flags that reach it."""
    monkeypatch.delenv(SECRET_ENV, raising=False)  # the tool takes it out of this process's environment
    secret_file = str(tmp_path / "secret")
    secret = create_secret_file(secret_file)
    service = ClusterService(Journal(str(tmp_path / "journal.db")), "max_min_fairness_perf", 10.0,
                             str(tmp_path / "work"), secret=secret)
    service.register_worker("host-a", "127.0.0.1", {"fast": 1, "slow": 1}, {})
    service.before_round()  # what the round loop does at once when a worker registers
    server = serve(service, "127.0.0.1", 0, secret)
    try:
        yield service, ["--scheduler", f"127.0.0.1:{server.server_address[1]}", "--secret-file", secret_file]
    finally:
        server.shutdown()
        server.server_close()


def submit(capsys, flags: list, name: str, *words: str) -> tuple:
    """``tools/cluster.py submit FLAGS --name NAME WORDS``: its exit status, stdout and stderr's lines (less
    megapipe's ``note:`` lines, which the service, parsing the job in this same process, may print)."""
    code = TOOL.main(["submit", *flags, "--name", name, *words])
    out = capsys.readouterr()
    return code, out.out, [line for line in out.err.splitlines() if not line.startswith("note: ")]


def test_submit_says_at_once_why_a_job_cannot_be_placed_and_still_queues_it(scheduler, capsys):
    service, flags = scheduler
    assert submit(capsys, flags, "wide", "--", *WIDE) == (
        0, "0\n", [f"job 0 accepted but no registered worker type can hold it now, so it waits in the queue: "
                   f"{NEEDS_TWO}"])
    assert submit(capsys, flags, "narrow", "--", *SMALL) == (0, "1\n", [])
    assert [job["waiting"] for job in service.status()["jobs"]] == [NEEDS_TWO, None]  # status: the same reason
    assert [job.job_id for job in service.source.pending] == [0, 1]


def test_submit_strict_refuses_such_a_job_in_one_sentence_and_queues_nothing(scheduler, capsys):
    service, flags = scheduler
    assert submit(capsys, flags, "wide", "--strict", "--", *WIDE) == (2, "", [f"error: {REFUSED}"])
    assert service.journal.jobs() == [] and service.source.pending == []
    assert submit(capsys, flags, "narrow", "--strict", "--", *SMALL) == (0, "0\n", [])
    assert [row.name for row in service.journal.jobs()] == ["narrow"]
