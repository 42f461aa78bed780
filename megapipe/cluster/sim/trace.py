"""Job traces: the original system's tab-separated format, and the chapter's generator.

The generator follows seed 002 section 5.7.1: Poisson arrivals; durations on a V100 of 10^x
minutes with x uniform in [1.5, 3] w.p. 0.8 and in [3, 4] w.p. 0.2, converted into steps with the
job's V100 throughput; worker counts 1 (70%), 2-4 (25%: 2 or 4, the measured ones), 8 (5%)
in the multi-worker regime.
"""

from __future__ import annotations

import random
from pathlib import Path

from megapipe.atomic_files import write_atomically
from megapipe.cluster.core.jobs import Job
from megapipe.cluster.core.throughputs import ThroughputTable
from megapipe.errors import ConfigError

FIELDS = ("job type", "command", "working directory", "steps flag", "needs data directory",
          "total steps", "scale factor", "priority weight", "SLO", "arrival time")


def read_trace(path: str | Path, throughputs: ThroughputTable | None = None) -> list[Job]:
    """Parse a trace; a bad line or unknown job type is refused naming the line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"--trace {path} cannot be read ({error.strerror}); pass an existing trace file.")
    known = throughputs.job_types() if throughputs is not None else None
    jobs = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        where = f"--trace {path} line {number}"
        if len(fields) != len(FIELDS):
            missing = FIELDS[len(fields)] if len(fields) < len(FIELDS) else "nothing (too many fields)"
            raise ConfigError(f"{where} has {len(fields)} tab-separated fields, not {len(FIELDS)} (first missing: {missing}); fix the line.")
        try:
            job = Job(
                job_id=len(jobs), job_type=fields[0], command=fields[1], working_directory=fields[2],
                num_steps_arg=fields[3], needs_data_dir=bool(int(fields[4])), total_steps=int(fields[5]),
                scale_factor=int(fields[6]), priority_weight=float(fields[7]),
                slo=None if float(fields[8]) < 0 else float(fields[8]), arrival_time=float(fields[9]))
        except ValueError as error:
            raise ConfigError(f"{where} has a malformed number ({error}); fix the line.")
        if known is not None and job.job_type not in known:
            raise ConfigError(f"{where}: job type {job.job_type!r} is not in the throughputs file; use a known type or add its throughputs.")
        if job.total_steps <= 0 or job.scale_factor <= 0:
            raise ConfigError(f"{where}: total steps and scale factor must be positive.")
        if jobs and job.arrival_time < jobs[-1].arrival_time:
            raise ConfigError(f"{where} arrives before the line above it; sort the trace by arrival time.")
        jobs.append(job)
    if not jobs:
        raise ConfigError(f"--trace {path} holds no jobs; pass a non-empty trace.")
    return jobs


def format_job(job: Job) -> str:
    slo = -1.0 if job.slo is None else job.slo
    return "\t".join([job.job_type, job.command, job.working_directory, job.num_steps_arg,
                      str(int(job.needs_data_dir)), str(job.total_steps), str(job.scale_factor),
                      f"{job.priority_weight:g}", f"{slo:f}", f"{job.arrival_time:.0f}"])


def write_trace(jobs: list[Job], path: str | Path) -> None:
    """Write atomically: a reader never sees half a trace."""
    write_atomically(str(path), "".join(format_job(job) + "\n" for job in jobs))


def sample_duration_minutes(rng: random.Random) -> float:
    low, high = (1.5, 3.0) if rng.random() < 0.8 else (3.0, 4.0)
    return 10 ** rng.uniform(low, high)


def sample_scale_factor(rng: random.Random) -> int:
    """1 (70%), 2 (10%) or 4 (15%) for the chapter's 2-4 (the measured scale factors), 8 (5%)."""
    draw = rng.random()
    if draw < 0.70:
        return 1
    if draw < 0.80:
        return 2
    if draw < 0.95:
        return 4
    return 8


def generate_trace(throughputs: ThroughputTable, num_jobs: int, jobs_per_hour: float, seed: int = 0,
                   multi_worker: bool = False, job_types: list[str] | None = None,
                   reference_worker: str = "v100") -> list[Job]:
    """Jobs with Poisson arrivals at ``jobs_per_hour`` (0: all at time 0) and the chapter's durations.

    A job type without a throughput at the drawn scale factor is redrawn; job types are uniform over
    ``job_types`` (default: every type the table has at scale factor 1 on the reference worker).
    """
    rng = random.Random(seed)
    types = sorted(job_types or {t for (t, s) in throughputs.isolated[reference_worker] if s == 1})
    jobs, now = [], 0.0
    for job_id in range(num_jobs):
        if jobs_per_hour > 0 and job_id > 0:
            now += rng.expovariate(jobs_per_hour / 3600.0)
        scale = sample_scale_factor(rng) if multi_worker else 1
        job_type = rng.choice(types)
        while throughputs.alone(job_type, scale, reference_worker) <= 0:
            job_type = rng.choice(types)
        steps = int(sample_duration_minutes(rng) * 60 * throughputs.alone(job_type, scale, reference_worker))
        jobs.append(Job(job_id=job_id, job_type=job_type, total_steps=max(steps, 1), scale_factor=scale,
                        arrival_time=round(now)))
    return jobs
