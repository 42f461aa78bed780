"""Everything the service knows of one job in memory, in one record: ``ClusterService.jobs`` holds one per job.

The journal (``journal.py``) owns a job's durable columns (state, checkpointed iterations, lease
number, overheads); the record holds the rest: what was submitted, the live run and its lease,
the fence against runs the service did not launch, the round's placement, measured rates and
costs. The service's parts (submission, leases, runs, rounds, status) all read and write these
records under the service's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megapipe.cluster.service.job_log import MeasuredThroughput
from megapipe.cluster.service.job_spec import JobSpec


@dataclass
class Run:
    """One launch of a job: its lease and what its rank 0 reported."""

    lease: int  # the lease's number, the run's fencing token: a report under another is told to stop
    hosts: tuple
    launched_at: float
    start_iteration: int
    lease_end: float
    iteration: int = 0
    last_report: float = 0.0  # when the iteration last advanced
    first_progress: Optional[tuple] = None  # (time, iteration) of the first iteration done
    stop_requested: Optional[float] = None
    seconds_per_iteration: float = 0.0
    stragglers: list = field(default_factory=list)  # the ranks its rank 0 last reported slower than their peers


@dataclass
class JobRecord:
    """One job as the service knows it (times are the service clock's unless said otherwise)."""

    id: int
    spec: JobSpec
    run: Optional[Run] = None  # the live launch by this service, if any
    fenced_at: Optional[float] = None  # monotonic time a run this service did not launch last reported
    ranks_alive: bool = False  # some agent reports ranks of it, as of the last tick
    cancel_requested: bool = False  # cancelled; the round loop's next tick takes it out of the scheduler
    finished: bool = False  # done: never launched again
    placement: Optional[tuple] = None  # the current round's host slots for it
    unplaceable: Optional[str] = None  # why no worker type can hold it, as last announced
    last_command: Optional[list] = None  # the command (layout) of its previous launch by this service
    rates: dict = field(default_factory=dict)  # worker type -> measured iterations/s
    log_reader: Optional[MeasuredThroughput] = None  # the reader of its log's iteration times
    costs: Optional[dict] = None  # seconds of its starts and stops (``cost_sheet``; this incarnation's only)

    def cost_sheet(self) -> dict:
        """Seconds the job spent not training, per kind (what a simulator of this cluster needs): its first
        start, each relaunch (to the first iteration), each stop (to its ranks' exit) and its last exit."""
        if self.costs is None:
            self.costs = {"first_start": None, "restarts": [], "stops": [], "exit": None}
        return self.costs
