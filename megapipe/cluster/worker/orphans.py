"""Ranks that a previous incarnation of this host's worker agent started, found again after a restart.

A killed agent leaves its jobs' processes running (each job in a session of its own). The
restarted agent reports them as running until they end, so the scheduler launches no second run of
such a job while the first is still alive (it is told to stop at its next lease report, saves and
exits). Each job's processes carry ``MEGAPIPE_CLUSTER_JOB`` and ``MEGAPIPE_CLUSTER_AGENT`` (the
agent's host name and scheduler: several clusters, or test agents, may share a machine and a host
name) in their environment, read from ``/proc`` (Linux; elsewhere nothing is found).
"""

from __future__ import annotations

import os

JOB, AGENT = "MEGAPIPE_CLUSTER_JOB", "MEGAPIPE_CLUSTER_AGENT"


def agent_identity(host: str, scheduler: str) -> str:
    """What ``MEGAPIPE_CLUSTER_AGENT`` holds for the jobs of the agent of ``host`` under ``scheduler``."""
    return f"{host}@{scheduler}"


def orphaned_jobs(identity: str) -> dict[int, list[int]]:
    """Job id -> pids of the live processes an agent of this ``agent_identity`` started (not this one)."""
    found: dict[int, list[int]] = {}
    names = os.listdir("/proc") if os.path.isdir("/proc") else []
    for pid in filter(str.isdigit, names):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                variables = dict(entry.partition(b"=")[::2] for entry in environ.read().split(b"\0") if entry)
        except OSError:  # ended meanwhile, or not ours to read
            continue
        job = variables.get(JOB.encode(), b"")
        if variables.get(AGENT.encode()) == identity.encode() and job.isdigit():
            found.setdefault(int(job), []).append(int(pid))
    return found


def any_alive(pids: list[int]) -> bool:
    return any(os.path.exists(f"/proc/{pid}") for pid in pids)
