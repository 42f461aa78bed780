"""A watchdog per rank that turns a hang into one report file and one sentence, before the collective timeout.

Each rank's watchdog thread reads the rank's progress (``parallel/progress.py``: the collective or
message wait it is in, the pipeline action it runs). When the rank has waited in one collective or for
one message longer than ``--hang-watchdog-seconds`` (shorter than ``--distributed-timeout-minutes``,
whose collectives would otherwise only fail much later, each rank with its own error; a long
computation or save outside a collective is not a hang):

1. it asks every rank where it is, through the job's key-value store, which does not go through the
   stuck communicators: every rank's watchdog answers with its host, its progress and its main thread's
   Python stack, even when that thread is blocked in a collective;
2. the first stalled rank gathers the answers (for a bounded time: a dead rank never answers), writes
   them to one JSON file (``--hang-report``, written atomically), and names the stuck collective, its
   group and the members that never entered it (fewer of that group's collectives counted) or never
   answered, in one sentence, printed once;
3. every stalled rank then exits with status 3: its main thread is blocked inside a collective and
   cannot be woken, and the job's launcher ends the others.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Optional

from megapipe.atomic_files import write_atomically
from megapipe.parallel.launch import job_store
from megapipe.parallel.progress import PROGRESS

HANG_EXIT_STATUS = 3
ASKED, WRITER, WRITTEN, STATE = "megapipe/hang/asked", "megapipe/hang/writer", "megapipe/hang/written", \
    "megapipe/hang/state/"


class HangWatchdog:
    """Watches this rank's progress from a daemon thread (module docstring); ``stop`` ends it."""

    def __init__(self, rank: int, world_size: int, limit_seconds: float, report_path: str,
                 gather_seconds: Optional[float] = None, exit=os._exit):
        self.rank, self.world_size, self.limit = rank, world_size, limit_seconds
        self.report_path, self.exit = report_path, exit
        self.gather_seconds = gather_seconds if gather_seconds is not None else min(10.0, limit_seconds)
        self.store = job_store()
        self._stopped = threading.Event()
        self._answered = False
        self._thread = threading.Thread(target=self._watch, name="megapipe-hang-watchdog", daemon=True)
        self._main = threading.main_thread().ident

    def start(self) -> "HangWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    # ---- the watching thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        poll = min(1.0, self.limit / 4)
        while not self._stopped.wait(poll):
            if not self._answered and self.store.check([ASKED]):
                self._answer()
            waiting = PROGRESS.waiting
            if waiting is not None and time.monotonic() - waiting.since > self.limit:
                self._stalled()
                return

    def _answer(self) -> None:
        """Publish where this rank is, for the writer of the report."""
        frame = sys._current_frames().get(self._main)
        state = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), **PROGRESS.snapshot(),
                 "stack": traceback.format_stack(frame) if frame is not None else []}
        self.store.set(f"{STATE}{self.rank}", json.dumps(state))
        self._answered = True

    def _stalled(self) -> None:
        self.store.set(ASKED, str(self.rank))
        self._answer()
        if self.store.add(WRITER, 1) == 1:
            states = self._gather()
            sentence = hang_sentence(self.rank, states, self.limit, self.report_path)
            write_atomically(self.report_path, json.dumps({"sentence": sentence, "ranks": states}, indent=1))
            print(f"error: {sentence}", file=sys.stderr, flush=True)
            self.store.set(WRITTEN, "1")
        else:  # the store lives in rank 0's process: wait for the writer before leaving
            self._wait_for(lambda: self.store.check([WRITTEN]), self.gather_seconds + 5)
        self.exit(HANG_EXIT_STATUS)

    def _gather(self) -> dict[int, dict]:
        keys = [f"{STATE}{rank}" for rank in range(self.world_size)]
        self._wait_for(lambda: self.store.check(keys), self.gather_seconds)
        return {rank: json.loads(self.store.get(key)) for rank, key in enumerate(keys) if self.store.check([key])}

    def _wait_for(self, done, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not done() and time.monotonic() < deadline:
            self._stopped.wait(0.05)


def hang_sentence(rank: int, states: dict[int, dict], limit: float, report_path: str) -> str:
    """One sentence: the stuck collective (the longest waited, else this rank's action), its group and the
    members that never entered it or never answered; then where the report is."""
    where = f"where every rank is: {report_path}."
    stuck = [(state["waiting"]["seconds"], r, state["waiting"]) for r, state in states.items()
             if state.get("waiting") and state["waiting"]["number"] > 0]
    if not stuck:
        waits = [(state["waiting"]["seconds"], r, state["waiting"]) for r, state in states.items()
                 if state.get("waiting")]
        if waits:  # a message between two ranks: its name says the peer
            _, r, waiting = max(waits)
            return f"rank {r} waited {waiting['seconds']:.0f} s on {waiting['name']}, which never came; {where}"
        return (f"rank {rank} made no progress for {limit:.0f} s in {states.get(rank, {}).get('action', '?')}; "
                f"{where}")
    _, r, waiting = max(stuck)
    group_key, number = ",".join(map(str, waiting["ranks"])), waiting["number"]
    silent = [m for m in waiting["ranks"] if m not in states]
    behind = [m for m in waiting["ranks"] if m in states and states[m]["entered"].get(group_key, 0) < number]
    parts = []
    if behind:
        parts.append(f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} never entered it (" +
                     "; ".join(f"rank {m} is at {states[m]['action']}" for m in behind) + ")")
    if silent:
        parts.append(f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} never answered (dead or "
                     "unreachable)")
    why = " and ".join(parts) if parts else "every member entered it; the communication itself is stuck"
    return (f"rank {r} has waited {waiting['seconds']:.0f} s in {waiting['name']} number {number} over "
            f"{waiting['group']}: {why}; {where}")
