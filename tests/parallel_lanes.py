"""How the suite shares two cores under ``pytest -n 2`` (the README's test command): a paced lane and
a background lane.

Many system tests are paced by the clock: scheduling rounds, grace periods, peer timeouts, deadlines
they assert. They wait for about half their time, and run next to other heavy tests they slow down
two to three times (a cluster's jobs need more rounds, so more relaunches), which made two plain
pytest-xdist workers slower than one. So, under ``pytest -n`` (``--dist load``, its default, or
``loadgroup``):

* the paced files (``PACED_FILES``) form one ``xdist_group``, first in the collection: one worker runs
  them one after another, from the start;
* every other file is a group of its own (its module-scoped worlds, clusters and checkpoints start
  once), the files with system tests first, then distributed, then unit ones, so that the last groups
  handed out are short (xdist's reordering by test count is turned off to keep this order);
* while a worker runs a test that is not paced, it and every process it starts from then on run at
  a lower CPU priority (``BACKGROUND_NICENESS``), so they take the cycles the paced tests leave idle
  instead of slowing them down. The paced lane is its worker's first group, so no priority is ever
  raised back (which would need root); the worker's process server (``worlds.preloaded_context``) is
  lowered with it, since the processes it forks inherit its priority.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os

import pytest

# Files whose tests wait on the clock: scheduling rounds, grace periods, peer and rendezvous timeouts,
# the deadlines of the acceptance runner's steps; Slurm's (two private Slurm clusters at once time out
# waiting for each other's jobs) among them.
PACED_FILES = ("test_cluster_service.py", "test_cluster_service_slurm.py", "test_cluster_slurm.py",
               "test_cluster_crash.py", "test_cluster_agent_stop.py", "test_cluster_lease.py",
               "test_multihost_faults.py", "test_preemption.py", "test_checkpoint_kill.py",
               "test_checkpoint_crash.py", "test_acceptance.py", "test_node_layout.py",
               "test_generation_server_fuzz.py")
PACED_GROUP = "paced"
BACKGROUND_NICENESS = 15  # a thirtieth of a busy paced process's weight: the background takes what the paced lane leaves
TIER_ORDER = ("system", "distributed", "unit")
LANES = "MEGAPIPE_TEST_LANES"


def in_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def group_of(item) -> str:
    return PACED_GROUP if item.path.name in PACED_FILES else item.path.name


def order_for_workers(items: list, tier_of) -> None:
    """Sort ``items`` in place: the paced lane first, then whole files by their heaviest tier (stable)."""
    heaviest: dict = {}
    for item in items:
        rank = TIER_ORDER.index(tier_of(item))
        heaviest[item.path] = min(rank, heaviest.get(item.path, rank))
    items.sort(key=lambda item: (group_of(item) != PACED_GROUP, heaviest[item.path]))


def pytest_configure(config):
    """Under ``pytest -n``, xdist's group scheduling in the collection's order (see the module docstring):
    the controller chooses it and tells its workers (through ``LANES``, in the environment they inherit)
    to name each test's group as ``--dist loadgroup`` would have them."""
    if config.getoption("dist", "no") in ("load", "loadgroup"):
        config.option.dist, config.option.loadscopereorder = "loadgroup", False
        os.environ[LANES] = "1"
    elif in_worker() and os.environ.get(LANES):
        config.option.loadgroup = True


def _lower_priority(niceness: int) -> None:
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    for pid in (0, server) if server else (0,):
        try:
            if os.getpriority(os.PRIO_PROCESS, pid) < niceness:
                os.setpriority(os.PRIO_PROCESS, pid, niceness)
        except (PermissionError, ProcessLookupError):
            pass  # a server that has exited, or a system that refuses: the order still holds


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start processes
def pytest_runtest_setup(item):
    if in_worker() and group_of(item) != PACED_GROUP:
        _lower_priority(BACKGROUND_NICENESS)
