"""The server's requests in arrival order: a bounded queue that one worker empties, one request at a time.

Connections are handled concurrently, but every rank runs a request together, so the requests
run one after the other. Each request waits for the worker until its deadline: one not started by
then is given up (its connection answers 504) and the worker passes over it; one started runs to
its end (a generation stops itself at the deadline, see ``deadline.py``).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional


class QueueFull(Exception):
    """Every place in the queue is taken."""


class Job:
    """One request's command, deadline and outcome, shared by its connection and the worker."""

    def __init__(self, command: tuple, deadline: float):
        self.command, self.deadline = command, deadline
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._state = "queued"  # -> "running" (the worker took it) or "expired" (its connection gave up)
        self._started, self._done = threading.Event(), threading.Event()

    def start(self) -> bool:
        """The worker takes the job, unless its connection already gave it up."""
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "running"
        self._started.set()
        return True

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self.result, self.error = result, error
        self._done.set()

    def wait(self, clock: Callable[[], float] = time.monotonic) -> bool:
        """The connection's wait: True once the job ran, False if it was still queued at its deadline."""
        self._started.wait(max(0.0, self.deadline - clock()))
        with self._lock:
            if self._state == "queued":
                self._state = "expired"
                return False
        self._done.wait()
        return True


class RequestQueue:
    """At most ``capacity`` jobs waiting (the running one aside)."""

    def __init__(self, capacity: int):
        self._queue: queue.Queue = queue.Queue(capacity)

    def submit(self, job: Job) -> Job:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        return job

    def next(self) -> Job:
        """The worker's next job to run, in arrival order, passing over those given up."""
        while True:
            job = self._queue.get()
            if job.start():
                return job
