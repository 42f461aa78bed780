"""A job's processes on a host, as process groups: torchrun's own and one per worker.

torchrun starts each worker in a session (so a process group) of its own, so a signal to
torchrun's group reaches torchrun alone. Whatever must reach all of a job (a worker agent
stopping it, the throttle pausing it) signals every group of the process tree under torchrun.
Read from ``/proc`` (Linux), at the moment of signalling, so workers started later are found.
"""

from __future__ import annotations

import os


def process_groups(pid: int) -> list[int]:
    """The process groups of ``pid`` and of all its descendants, ``pid``'s own first; [] once it is gone."""
    found, stack = [], [pid]
    while stack:
        process = stack.pop()
        try:
            with open(f"/proc/{process}/stat") as stat:
                group = int(stat.read().rpartition(")")[2].split()[2])  # fields after the name: state ppid pgrp
            children = []
            for task in os.listdir(f"/proc/{process}/task"):
                with open(f"/proc/{process}/task/{task}/children") as listed:
                    children += [int(child) for child in listed.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended meanwhile
        if group not in found:
            found.append(group)
        stack += children
    return found


def signal_groups(groups: list[int], sig: int) -> None:
    """``sig`` to each of ``groups``; a group that has ended meanwhile is skipped."""
    for group in groups:
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            pass


def signal_tree(pid: int, sig: int) -> None:
    """``sig`` to every process group of ``pid``'s tree (see the module docstring)."""
    signal_groups(process_groups(pid), sig)
