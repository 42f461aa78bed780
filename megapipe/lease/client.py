"""The training side of a cluster lease (``--cluster-lease ADDRESS``), as Gavel's GavelIterator does it.

A job placed by the scheduler service holds a lease that ends with the round. One rank (global
rank 0) reports its iteration to ``ADDRESS`` about once a second (how the scheduler sees
progress and measures throughput) and, when the next iteration would overrun the lease (or
the iterations the ranks take to agree on a stop, ``exit_lag``), asks to renew it. The scheduler
answers with the seconds left in the renewed lease when the job keeps its workers next round,
or with ``stop`` (a new allocation, a cancel, a restarted scheduler); the training loop then
saves a checkpoint and exits cleanly, and resumes from it on its next allocation. With the
scheduler unreachable the lease runs out and the job stops the same way. Reports are signed
with the key the scheduler gave this launch for its lease alone (``MEGAPIPE_CLUSTER_LEASE_KEY``).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Optional

from megapipe.lease.auth import LEASE_KEY_ENV, sign

REPORT_SECONDS = 1.0  # how often progress is reported between renewals
ANSWER_SECONDS = 3600.0  # longest wait for an answer (a renewal is answered when the next round is planned)
UNREACHABLE_GRACE = 5.0  # seconds past the lease's end a job waits for an unreachable scheduler


def scheduler_url(scheduler: str) -> str:
    """``HOST:PORT`` as ``http://HOST:PORT``; a full ``http(s)://...`` address (a TLS proxy's) as given."""
    return scheduler.rstrip("/") if "://" in scheduler else f"http://{scheduler}"


def post_json(url: str, body: dict, timeout: float, key: Optional[bytes] = None) -> dict:
    """POST ``body`` as JSON, signed with ``key`` if given; the decoded answer (an error answer's JSON body too)."""
    data = json.dumps(body).encode()
    return _exchange(urllib.request.Request(url, data, {"Content-Type": "application/json",
                                                        **(sign(key, "POST", url, data) if key else {})}), timeout)


def get_json(url: str, timeout: float, key: Optional[bytes] = None) -> dict:
    """GET ``url``, signed with ``key`` if given; the decoded answer (an error answer's JSON body too)."""
    return _exchange(urllib.request.Request(url, headers=sign(key, "GET", url) if key else {}), timeout)


def _exchange(request: urllib.request.Request, timeout: float) -> dict:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        return json.loads(error.read() or b"{}")


class ClusterLease:
    """Reports progress and renews the lease; ``stop_reason`` says when the job must save and exit."""

    def __init__(self, address: str, exit_lag: int = 0, key: Optional[bytes] = None):
        self.address = address
        self.key = key or os.environ.get(LEASE_KEY_ENV, "").encode() or None  # unsigned without one
        self.exit_lag = exit_lag  # iterations between a stop reported here and the exit (the ranks' agreement)
        self.deadline: Optional[float] = None  # local monotonic time the lease ends; None until granted
        self.last_report = -float("inf")
        self.trained = False  # an iteration was reported (the first one at once: it ends the start-up)
        self.last_iteration_time: Optional[float] = None
        self.seconds_per_iteration = 0.0
        self.stopped: Optional[str] = None
        self.stragglers: list[dict] = []  # the ranks slower than their peers now (``training/stragglers.py``)

    def start(self, iteration: int) -> None:
        """The first report (after loading the checkpoint) takes the lease."""
        self._report(iteration, renew=False)
        self.last_iteration_time = time.monotonic()

    def stop_reason(self, iteration: int) -> Optional[str]:
        """Called after every iteration: None to go on, or why the job must save and exit now.

        An iteration's time is counted from the end of the previous report: a renewal that waited
        for the next round is not training time (counted, it would make every later iteration ask
        to renew and wait again)."""
        now = time.monotonic()
        if self.last_iteration_time is not None:
            self.seconds_per_iteration = now - self.last_iteration_time
        self.last_iteration_time = now
        if self.stopped:
            return self.stopped
        ahead = 1.5 + self.exit_lag  # the next iteration, with a margin, and those before a stop takes effect
        ends_soon = self.deadline is not None and now + ahead * self.seconds_per_iteration >= self.deadline
        if ends_soon or not self.trained or now - self.last_report >= REPORT_SECONDS:
            self._report(iteration, renew=ends_soon)
            self.trained = True
            self.last_iteration_time = time.monotonic()
        return self.stopped

    def finish(self, iteration: int) -> None:
        """Tell the scheduler this run of the job is exiting (the lease is free for its next allocation)."""
        try:
            post_json(self.address, {"iteration": iteration, "exiting": True}, timeout=5, key=self.key)
        except OSError:
            pass  # a scheduler that is down learns the end from the worker agent instead

    def _report(self, iteration: int, renew: bool) -> None:
        body = {"iteration": iteration, "seconds_per_iteration": self.seconds_per_iteration, "renew": renew,
                "stragglers": self.stragglers}
        while True:
            try:
                answer = post_json(self.address, body, timeout=ANSWER_SECONDS, key=self.key)
                break
            except OSError:
                if not renew:
                    return
                if self.deadline is not None and time.monotonic() > self.deadline + UNREACHABLE_GRACE:
                    self.stopped = "the cluster lease ran out with the scheduler unreachable"
                    return
                time.sleep(0.5)
        self.last_report = time.monotonic()
        if "error" in answer:
            self.stopped = f"the scheduler refused the lease: {answer['error']}"
        elif answer.get("stop"):
            self.stopped = f"the cluster lease ended ({answer['stop']})"
        else:
            self.deadline = self.last_report + float(answer["expires_in"])
