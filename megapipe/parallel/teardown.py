"""Closing torch.distributed at the end of a process: every group destroyed, subgroups first, and
their gloo threads joined while the interpreter is still whole.

``dist.destroy_process_group()`` only shuts the backends down and forgets them; a group's C++
object, and each gloo group's worker threads, live on while Python still references it (the
groups a ``ParallelState`` built, a lagged agreement's or an asynchronous writer's group). They
were then freed in the interpreter's teardown, where a worker thread that drops the last
reference to a tensor of a completed work needs the GIL, is ended by the exiting interpreter
mid-C++ and aborts the process ("terminate called without an active exception", exit -6) after
a successful run, the more often the busier the machine. Here the references go first and the
groups are freed at once: freeing a group releases the GIL and joins its threads.
"""

from __future__ import annotations

import gc

import torch.distributed as dist
from torch.distributed import distributed_c10d

from megapipe.parallel.state import forget_groups


def close_distributed() -> None:
    """Destroy every process group of this process (subgroups in reverse order of creation, then
    the default group) and free them now; a no-op when torch.distributed is not initialized.

    Every rank's pending works must be complete (waited for) before; the groups' peers need not
    be here any more: nothing here is collective."""
    if not dist.is_initialized():
        return
    _destroy_subgroups()
    forget_groups()
    dist.destroy_process_group()
    gc.collect()  # the run's objects (and the groups they hold) sit in reference cycles


def _destroy_subgroups() -> None:
    """Every group but the default one, newest first (torch keeps them in order of creation)."""
    subgroups = [group for group in distributed_c10d._world.pg_names if group is not dist.group.WORLD]
    for group in reversed(subgroups):
        dist.destroy_process_group(group)
