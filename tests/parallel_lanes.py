"""How the suite shares two cores under ``pytest -n 3`` (the README's test command): a paced lane and
a background lane of two workers.

Many system tests are paced by the clock: scheduling rounds, grace periods, peer timeouts, deadlines
they assert. They wait for about half their time, and run next to other heavy tests they slow down
two to three times (a cluster's jobs need more rounds, so more relaunches), which made two plain
pytest-xdist workers slower than one. So, under ``pytest -n`` (``--dist load``, its default, or
``loadgroup``):

* the paced files (``PACED_FILES``) form one ``xdist_group``, first in the collection: one worker runs
  them one after another, from the start;
* every other file is a group of its own (its module-scoped worlds, clusters and checkpoints start
  once), the files with system tests first, then distributed, then unit ones, the longest of a tier
  (``LONGEST_FILES``) first in it, so that the last groups handed out are short (xdist's reordering by
  test count is turned off to keep this order);
* the other workers (two: one alone often leaves a core idle, as when it runs a one-process test while
  the paced lane waits on the clock) take the background's groups as they finish the previous ones;
* while a worker runs a test that is not paced, it and every process it starts from then on run at
  a lower CPU priority, so they take the cycles the paced tests leave idle instead of slowing them
  down: niceness ``BACKGROUND_NICENESS``, and, where the controller may make one (root, at the root of
  a CPU hierarchy), a CPU control group weighted a quarter of one busy process. The group is what works
  where the kernel shares the CPU between sessions first (autogroup): every forked script and torchrun
  worker starts a session, and a niceness counts only within its own (measured: at niceness 15 alone
  the paced lane took as long as at 5). The paced lane is its worker's first group, so no priority is
  ever raised back; the worker's process server (``worlds.preloaded_context``) moves with it, since
  the processes it forks inherit its place.
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
# Files far longer than the rest of their tier (measured: the transport models' replays take about 50 s
# in one process, three times the next unit file), handed out first within it instead of near the end.
LONGEST_FILES = ("test_transport_models.py",)
BACKGROUND_NICENESS = 15  # a thirtieth of a busy paced process's weight, within one session
TIER_ORDER = ("system", "distributed", "unit")
LANES = "MEGAPIPE_TEST_LANES"  # from the controller to its workers: the background's CPU group, or "niceness only"


def in_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def group_of(item) -> str:
    return PACED_GROUP if item.path.name in PACED_FILES else item.path.name


def order_for_workers(items: list, tier_of) -> None:
    """Sort ``items`` in place: the paced lane first, then whole files by their heaviest tier, the longest
    files of a tier first in it (stable)."""
    heaviest: dict = {}
    for item in items:
        rank = TIER_ORDER.index(tier_of(item))
        heaviest[item.path] = min(rank, heaviest.get(item.path, rank))
    items.sort(key=lambda item: (group_of(item) != PACED_GROUP, heaviest[item.path],
                                 item.path.name not in LONGEST_FILES))


def pytest_configure(config):
    """Under ``pytest -n``, xdist's group scheduling in the collection's order (see the module docstring):
    the controller chooses it, makes the background lane's CPU group where it can, and tells its workers
    (through ``LANES``, in the environment they inherit) to name each test's group as ``--dist loadgroup``
    would have them."""
    if config.getoption("dist", "no") in ("load", "loadgroup"):
        config.option.dist, config.option.loadscopereorder = "loadgroup", False
        os.environ[LANES] = _make_background_group() or "niceness only"
    elif in_worker() and os.environ.get(LANES):
        config.option.loadgroup = True


def pytest_unconfigure(config):
    group = os.environ.get(LANES, "")
    if not in_worker() and os.path.isdir(group):
        _remove_group(group)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start processes
def pytest_runtest_setup(item):
    if in_worker() and group_of(item) != PACED_GROUP:
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        lower_priority([os.getpid()] + ([server] if server else []), os.environ.get(LANES))


def lower_priority(pids: list[int], group: str | None) -> None:
    """Move ``pids`` (and every process they start from then on) to the background lane: niceness
    ``BACKGROUND_NICENESS``, which only orders the processes of one session against each other where the
    kernel groups processes by session (autogroup), and so also into the background's CPU ``group`` (a
    control group's directory) where there is one. Nothing is ever raised back."""
    for pid in pids:
        try:
            if os.getpriority(os.PRIO_PROCESS, pid) < BACKGROUND_NICENESS:
                os.setpriority(os.PRIO_PROCESS, pid, BACKGROUND_NICENESS)
            if group and os.path.isdir(group):
                with open(os.path.join(group, "cgroup.procs"), "a") as procs:  # one pid per write, as the kernel takes them
                    procs.write(f"{pid}\n")
        except (PermissionError, ProcessLookupError):
            pass  # a server that has exited, or a system that refuses: the order still holds


def _cpu_controller() -> tuple | None:
    """(directory, weight file, a quarter of one busy process's weight) of the kernel's CPU controller where
    this process sits at the root of its hierarchy (cgroup v2, or v1's ``cpu``); None elsewhere."""
    own = open("/proc/self/cgroup").read().splitlines()
    unified = "/sys/fs/cgroup/cgroup.controllers"
    if "0::/" in own and os.path.exists(unified) and "cpu" in open(unified).read().split():
        return "/sys/fs/cgroup", "cpu.weight", "25"
    if any(line.endswith(":/") and "cpu" in line.split(":")[1].split(",") for line in own) and \
            os.path.exists("/sys/fs/cgroup/cpu/cpu.shares"):
        return "/sys/fs/cgroup/cpu", "cpu.shares", "256"
    return None


def _make_background_group() -> str | None:
    """A CPU control group for the background lane, weighted a quarter of one paced process; None where
    this process may not make one (not root, or not at the root of a CPU hierarchy)."""
    controller = _cpu_controller()
    if controller is None:
        return None
    root, weight_file, weight = controller
    group = os.path.join(root, f"megapipe-tests-background-{os.getpid()}")
    try:
        if weight_file == "cpu.weight":  # v2: the root hands the CPU controller down
            with open(os.path.join(root, "cgroup.subtree_control"), "w") as control:
                control.write("+cpu")
        os.makedirs(group, exist_ok=True)
        with open(os.path.join(group, weight_file), "w") as weight_out:
            weight_out.write(weight)
        return group
    except OSError:
        _remove_group(group)
        return None


def _remove_group(group: str) -> None:
    """Move what still runs in ``group`` back to its parent, and remove it."""
    try:
        for pid in open(os.path.join(group, "cgroup.procs")).read().split():
            with open(os.path.join(os.path.dirname(group), "cgroup.procs"), "w") as parent:
                parent.write(pid)
        os.rmdir(group)
    except OSError:
        pass
