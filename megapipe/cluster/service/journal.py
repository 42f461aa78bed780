"""The scheduler service's durable journal: every job, its state and progress, in SQLite.

SQLite ships with Python, commits each change as one atomic transaction and survives a killed
process (write-ahead log), which is what a restarted scheduler needs: it reopens the file and
finds every job as it was last written. The service is the only writer; each method is one
transaction.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    command TEXT NOT NULL,           -- JSON list: the submitted megapipe command line
    target_iters INTEGER NOT NULL,
    scale_factor INTEGER NOT NULL,
    priority REAL NOT NULL,
    state TEXT NOT NULL,             -- queued, running, done, failed or cancelled
    iterations INTEGER NOT NULL,     -- iterations in the job's last checkpoint (what survives a fault)
    submitted REAL NOT NULL,         -- wall-clock seconds
    finished REAL,
    error TEXT,
    log_path TEXT NOT NULL,
    save_dir TEXT NOT NULL,
    allocation TEXT,                 -- JSON: [[host, type, devices], ...] while running
    lease INTEGER NOT NULL DEFAULT 0, -- number of the job's current lease (0: none granted yet)
    throughputs TEXT NOT NULL DEFAULT '{}',  -- JSON: worker type -> measured iterations/s
    overhead REAL NOT NULL DEFAULT 0,        -- preemption: stopping, saving, relaunching, loading (seconds)
    fixed REAL NOT NULL DEFAULT 0,           -- starting the first run, finishing the last (seconds)
    relayouts INTEGER NOT NULL DEFAULT 0
);
"""


@dataclass
class JobRow:
    id: int
    name: str
    kind: str
    command: list
    target_iters: int
    scale_factor: int
    priority: float
    state: str
    iterations: int
    submitted: float
    finished: Optional[float]
    error: Optional[str]
    log_path: str
    save_dir: str
    allocation: Optional[list]
    lease: int
    throughputs: dict = field(default_factory=dict)
    overhead: float = 0.0
    fixed: float = 0.0
    relayouts: int = 0

    @property
    def jct(self) -> Optional[float]:
        return None if self.finished is None else self.finished - self.submitted


class Journal:
    def __init__(self, path: str):
        self.path = path
        self.lock = threading.Lock()
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(_SCHEMA)

    def _write(self, sql: str, values=()) -> int:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                cursor = self.db.execute(sql, values)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            return cursor.lastrowid

    def add_job(self, name: str, kind: str, command: list, target_iters: int, scale_factor: int, priority: float,
                log_dir: str, save_root: str) -> int:
        """Insert a queued job; its log and checkpoint paths are named after its id (one transaction)."""
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                job_id = (self.db.execute("SELECT COALESCE(MAX(id), -1) + 1 FROM jobs").fetchone()[0])
                self.db.execute(
                    "INSERT INTO jobs (id, name, kind, command, target_iters, scale_factor, priority, state, "
                    "iterations, submitted, log_path, save_dir) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', 0, ?, ?, ?)",
                    (job_id, name, kind, json.dumps(command), target_iters, scale_factor, priority, time.time(),
                     f"{log_dir}/job{job_id}.log", f"{save_root}/job{job_id}"))
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
        return job_id

    def update(self, job_id: int, **values) -> None:
        """Set columns of one job atomically; lists and dicts are stored as JSON."""
        unknown = set(values) - set(JobRow.__dataclass_fields__)
        if unknown:
            raise KeyError(f"journal has no column {sorted(unknown)[0]}")
        encoded = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in values.items()}
        assignments = ", ".join(f"{k} = ?" for k in encoded)
        self._write(f"UPDATE jobs SET {assignments} WHERE id = ?", (*encoded.values(), job_id))

    def jobs(self) -> list[JobRow]:
        with self.lock:
            rows = self.db.execute(f"SELECT {', '.join(JobRow.__dataclass_fields__)} FROM jobs ORDER BY id").fetchall()
        return [_row(r) for r in rows]

    def job(self, job_id: int) -> Optional[JobRow]:
        return next((j for j in self.jobs() if j.id == job_id), None)


def _row(values) -> JobRow:
    row = JobRow(*values)
    row.command = json.loads(row.command)
    row.allocation = json.loads(row.allocation) if row.allocation else None
    row.throughputs = json.loads(row.throughputs)
    return row
