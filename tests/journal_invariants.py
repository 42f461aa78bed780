"""The scheduler journal's invariants, checked while the service runs (the crash harness reads it after
every restart).

``JournalWatch.check`` reads the journal (``megapipe/cluster/service/journal.py``) read-only and
returns every violation, as sentences: states are known ones; ids run 0, 1, 2, ...; a running job
has an allocation and a lease and no finish time, a queued one neither allocation nor finish time;
a done job has its target iterations in its journal row and in its last checkpoint, and keeps its
finish time once set; no row counts more iterations than its checkpoints hold or than its target;
and between two checks of one watch, no job's iterations, checkpointed iteration or lease number
go back, and no finished job changes state.
"""

from __future__ import annotations

import sqlite3

from megapipe.checkpointing.paths import read_latest

STATES = {"queued", "running", "done", "failed", "cancelled"}
ENDED = {"done", "failed", "cancelled"}


class JournalWatch:
    def __init__(self, path: str):
        self.path = path
        self.seen: dict[int, dict] = {}  # job id -> its row (and checkpoint) at the last check

    def rows(self) -> list[dict]:
        db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
        try:
            db.row_factory = sqlite3.Row
            return [dict(row) for row in db.execute("SELECT * FROM jobs ORDER BY id")]
        finally:
            db.close()

    def check(self) -> list[str]:
        """Every invariant the journal breaks now (and against the last check), as sentences."""
        rows, problems = self.rows(), []
        if [row["id"] for row in rows] != list(range(len(rows))):
            problems.append(f"job ids are {[row['id'] for row in rows]}, not 0 to {len(rows) - 1}")
        for row in rows:
            job, state = row["id"], row["state"]
            checkpointed = read_latest(row["save_dir"]) or 0
            row["checkpointed"] = checkpointed
            if state not in STATES:
                problems.append(f"job {job} is in unknown state {state!r}")
            if state == "running" and (row["allocation"] is None or row["lease"] < 1 or row["finished"] is not None):
                problems.append(f"job {job} is running with allocation {row['allocation']}, lease {row['lease']} "
                                f"and finish time {row['finished']}")
            if state == "queued" and (row["allocation"] is not None or row["finished"] is not None):
                problems.append(f"job {job} is queued with allocation {row['allocation']} and finish time "
                                f"{row['finished']}")
            if state in ENDED and row["finished"] is None:
                problems.append(f"job {job} is {state} without a finish time")
            if state == "done" and not row["iterations"] == row["target_iters"] <= checkpointed:
                problems.append(f"job {job} is done with {row['iterations']} of {row['target_iters']} iterations in "
                                f"the journal and {checkpointed} checkpointed")
            if row["iterations"] > min(checkpointed, row["target_iters"]):
                problems.append(f"job {job} counts {row['iterations']} iterations, more than its checkpoints hold "
                                f"({checkpointed}) or its target ({row['target_iters']})")
            before = self.seen.get(job)
            if before is not None:
                for column in ("iterations", "checkpointed", "lease"):
                    if row[column] < before[column]:
                        problems.append(f"job {job}'s {column} went back from {before[column]} to {row[column]}")
                if before["state"] in ENDED and (row["state"], row["finished"]) != (before["state"],
                                                                                      before["finished"]):
                    problems.append(f"job {job} was {before['state']} (finished at {before['finished']}) and is now "
                                    f"{row['state']} (finished at {row['finished']})")
            self.seen[job] = row
        return problems
