"""Reading a cluster job's log (everything it printed over all its allocations) and running it alone.

The service writes one ``[cluster] lease N on HOSTS: COMMAND`` line before each launch (and a
``[cluster] done: ...`` line once the job has finished); the training loop logs every
``--log-interval`` iterations with its losses. ``iteration_losses`` gives each iteration's loss as
printed (its last print, should a killed run have logged iterations its checkpoint did not keep);
``overlapping_runs`` finds a run that printed while another of the same job was printing (the
iterations go back without a new lease line). ``run_alone`` trains the same command uninterrupted,
the reference for loss continuity. ``MeasuredThroughput`` reads, as the log grows, the job's speed
on each accelerator type from the iteration times it printed: the throughputs the scheduler uses
once a job has run on a type.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

LEASE = re.compile(r"^\[cluster\] lease (\d+) on (.*?): (\S+\.py .*)$")
ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([-+0-9.E]+) \|")
ITERATION_TIME = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|.*?\| elapsed time per iteration \(ms\): ([0-9.]+) \|")
SLOT = re.compile(r"^\S+:(\S+)x\d+$")  # host:TYPExN, as the lease line names each host of an allocation
SCHEDULER_FLAGS = ("--save", "--load", "--cluster-lease")
ROOT = Path(__file__).resolve().parents[3]


def iteration_losses(text: str) -> dict[int, str]:
    """Iteration -> lm loss as printed."""
    losses = {}
    for line in text.splitlines():
        match = ITERATION.match(line)
        if match:
            losses[int(match[1])] = match[2]
    return losses


def leases(text: str) -> list[tuple[int, str, list[str]]]:
    """(lease, hosts, command without the scheduler's flags) per launch, in order."""
    found = []
    for line in text.splitlines():
        match = LEASE.match(line)
        if match:
            words, command = match[3].split(), []
            skip = False
            for word in words:
                if skip:
                    skip = False
                elif word in SCHEDULER_FLAGS:
                    skip = True
                else:
                    command.append(word)
            found.append((int(match[1]), match[2], command))
    return found


def layout_key(command: list[str], devices: int) -> tuple:
    """(t, p, d, schedule, micro-batch size) of a training command on ``devices`` processes."""
    from megapipe.cli.parse import build_parser
    from megapipe.cluster.service.job_spec import SCRIPTS
    from megapipe.schedules.catalog import default_schedule

    args, _ = build_parser(SCRIPTS[os.path.basename(command[0])]).parse_known_args(command[1:])
    t, p = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    return t, p, devices // (t * p), args.pipeline_schedule or default_schedule(1), args.micro_batch_size


def iteration_layouts(text: str) -> dict[int, tuple]:
    """Iteration -> ``layout_key`` of the lease that trained it."""
    layouts, current = {}, None
    for line in text.splitlines():
        lease = LEASE.match(line)
        if lease:
            devices = sum(int(slot.rsplit("x", 1)[1]) for slot in lease[2].split(", "))
            current = layout_key(leases(line)[0][2], devices)
        match = ITERATION.match(line)
        if match:
            layouts[int(match[1])] = current
    return layouts


def overlapping_runs(text: str) -> list[int]:
    """Iterations printed out of order without a relaunch in between (two runs at once)."""
    bad, last = [], 0
    for line in text.splitlines():
        if LEASE.match(line):
            last = 0
            continue
        match = ITERATION.match(line)
        if match:
            iteration = int(match[1])
            if last and iteration != last + 1:
                bad.append(iteration)
            last = iteration
    return bad


def run_alone(command: list[str], devices: int, work_dir: str, port: int, timeout: float = 600,
              attempts: int = 2, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str:
    """Train ``command`` on ``devices`` local processes from scratch, uninterrupted; returns its output.

    A failed run is tried again once (``attempts``): a two-process run of this torch has been seen
    to abort in one rank's teardown after training to the end. ``run`` starts torchrun as
    ``subprocess.run`` would (the tests pass one that forks it from a server that has imported torch)."""
    os.makedirs(work_dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for _ in range(attempts):
        result = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(devices),
                      "--master-port", str(port), str(ROOT / command[0]), *command[1:]],
                     cwd=work_dir, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode == 0:
            return result.stdout
    raise RuntimeError(f"the reference run failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")


def continuity(text: str, reference: dict[int, str], submitted: list[str], devices: int) -> dict:
    """A job's losses over all its allocations against ``reference`` (the job alone, as submitted).

    ``exact_until``: the first iteration trained in another layout than the submitted one (the
    losses before it should be bit for bit the reference's: ``bit_exact_before``, and
    ``bit_exact_throughout`` when that is every iteration); ``max_relative``: the largest
    relative difference over all iterations; ``complete``: every iteration was logged.
    """
    got, layouts = iteration_losses(text), iteration_layouts(text)
    as_submitted = layout_key(submitted, devices)
    end = max(reference) + 1 if reference else 1
    exact_until = next((i for i in sorted(got) if layouts[i] != as_submitted), end)
    bit_exact_before = all(got[i] == reference[i] for i in got if i < exact_until)
    return {"complete": sorted(got) == list(range(1, end)),
            "exact_until": exact_until,
            "bit_exact_before": bit_exact_before,
            "bit_exact_throughout": bit_exact_before and exact_until == end,
            "max_relative": max((abs(float(got[i]) - float(reference[i])) / abs(float(reference[i])) for i in got),
                                default=0.0)}


class MeasuredThroughput:
    """Iterations/s of a job on each accelerator type, from the iteration lines of its log.

    Each line gives the mean time per iteration of the iterations since the previous line; a
    lease's first line is left out (it holds the start-up: lazy initialisation, the first
    iteration's allocations; the scheduler counts starting as overhead). Every later window,
    renewals and evaluations included, is time the job held its devices, so a type's rate is all
    those iterations over all that time, summed over every lease on the type. ``update`` reads
    what was appended since the last call (a line still being written waits for the next)."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0
        self.worker_type: Optional[str] = None  # of the current lease
        self.last_iteration: Optional[int] = None  # logged in the current lease
        self.totals: dict = {}  # worker type -> [iterations, seconds]

    def update(self) -> dict[str, float]:
        """Read new lines; returns iterations/s per type measured so far."""
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                data = log.read()
        except FileNotFoundError:
            data = b""
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            self._line(line)
        return self.rates()

    def _line(self, line: str) -> None:
        lease = LEASE.match(line)
        if lease:
            types = {SLOT.match(slot.strip())[1] for slot in lease[2].split(",")}
            self.worker_type = types.pop() if len(types) == 1 else None  # an allocation has one type
            self.last_iteration = None
            return
        match = ITERATION_TIME.match(line)
        if not match or self.worker_type is None:
            return
        iteration, milliseconds = int(match[1]), float(match[2])
        if self.last_iteration is not None and iteration > self.last_iteration:
            done = iteration - self.last_iteration
            totals = self.totals.setdefault(self.worker_type, [0, 0.0])
            totals[0] += done
            totals[1] += done * milliseconds / 1000
        self.last_iteration = iteration

    def rates(self) -> dict[str, float]:
        return {t: done / seconds for t, (done, seconds) in self.totals.items() if seconds > 0}

