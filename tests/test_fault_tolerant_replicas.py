"""Fault-tolerant replicas on two test hosts: a lost host costs one step, not a restart, and rejoins.

Each host runs one replica (its own torchrun) of a job of ``--fault-tolerant-replicas 2``; the lighthouse
runs on host 0. Host 1 is killed (every process SIGKILLed) after a seeded iteration; the survivor must log
the loss, resume within 60 s of the kill and go on alone at the same global batch; host 1 is then
relaunched with the same command and must rejoin from the survivor's state. After ten such cycles the
survivor's log must hold every iteration once (at most the step under way at each kill was discarded and
run again) with the losses and gradient norms, to every printed digit, of an independent reference:
ordinary runs chained through disk checkpoints, each at the layout the replicas had (d = 2 while both
lived, d = 1 while one did), switched at the same iterations. With p = 2 inside each replica the same
holds for a kill under 1F1B, interleaved 1F1B and ZB-V, whose lists are rebuilt for each width. Dropout is off: a checkpoint resharded to
another d re-seeds it, while a surviving replica continues its own random stream.

With a distributed optimizer inside each replica (d = 2 ranks per replica, ZeRO-3), the reference's
average over all four ranks is one reduce-scatter where the replicas take two stages (inside a replica,
then across), whose rounding differs by an ulp or so per step: there the losses must agree within
1e-5 relative, and exactly while one replica is left (the same arithmetic as d = 2 alone).
"""

from __future__ import annotations

import os
import random
import re
import sys
import time

import pytest

from checkpoint_helpers import TINY_GPT, layout_flags, session_cache
from launch_helpers import REPO, Job

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]
PORT = 29600
RUN_SECONDS = 180
RESUME_SECONDS = 60  # the bound on a kill-to-next-step pause
LOSS_LINE = re.compile(r"iteration\s+(\d+)/.*?lm loss: (\S+).*?grad norm: (\S+)")


def _flags(cache: str, *extra: str) -> list[str]:
    return [os.path.join(REPO, "pretrain_gpt.py"), *TINY_GPT, "--hidden-dropout", "0", "--attention-dropout", "0",
            "--train-iters", "5000", "--eval-interval", "100000", "--data-cache-path", cache, *extra]


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


class Replicas:
    """The lighthouse on host 0 and one replica per host, each a job whose output is read on its own."""

    def __init__(self, hosts, nproc: int, flags: list[str]):
        self.hosts, self.nproc, self.flags = hosts, nproc, flags
        self.address = f"{hosts[0].address}:{PORT}"
        self.lighthouse = Job(hosts.command(0, [sys.executable, "-m", "megapipe.replicas.lighthouse", "--replicas",
                                                "2", "--host", hosts[0].address, "--port", str(PORT),
                                                "--heartbeat-timeout-seconds", "2"]), forked=True)
        self.lighthouse.wait_for("lighthouse for 2 replicas", RUN_SECONDS)
        self.jobs = [self.launch(node) for node in range(2)]

    def launch(self, node: int) -> Job:
        return Job(self.hosts.command(node, _torchrun(self.nproc) + self.flags + [
            "--fault-tolerant-replicas", "2", "--replica-id", str(node), "--lighthouse", self.address,
            "--replica-timeout-seconds", "20"]), forked=True)

    def kill_and_rejoin(self, after: int) -> tuple[int, int, float]:
        """Kill host 1 once the survivor logged iteration ``after``, relaunch it once the survivor goes on alone;
        (first iteration alone, first iteration together again, seconds from the kill to the survivor's next step)."""
        survivor = self.jobs[0]
        survivor.wait_for(rf"iteration\s+{after}/", RUN_SECONDS)
        self.hosts.kill(1)
        killed = time.monotonic()
        self.jobs[1].close()
        alone = int(re.search(r"at iteration (\d+)", survivor.wait_for(r"replica\(s\) \[1\] lost at iteration",
                                                                        RUN_SECONDS))[1])
        survivor.wait_for(rf"iteration\s+{alone}/", RUN_SECONDS)
        resumed = time.monotonic() - killed
        self.jobs[1] = self.launch(1)
        together = int(re.search(r"at iteration (\d+)", survivor.wait_for(r"replica\(s\) \[1\] joined at iteration",
                                                                           RUN_SECONDS))[1])
        return alone, together, resumed

    def close(self) -> None:
        for job in self.jobs + [self.lighthouse]:
            job.close()


def logged(lines: list[str]) -> dict[int, tuple[str, str]]:
    """Iteration -> (loss, grad norm) as printed, failing on an iteration logged twice."""
    found: dict[int, tuple[str, str]] = {}
    for line in lines:
        match = LOSS_LINE.search(line)
        if match:
            assert int(match[1]) not in found, f"iteration {match[1]} logged twice"
            found[int(match[1])] = (match[2], match[3])
    return found


def reference(flags: list[str], switches: list[tuple[int, int]], last: int, root: str) -> dict[int, tuple[str, str]]:
    """The losses of ordinary runs chained through checkpoints in ``root``: ``switches`` lists (the last iteration
    at a width, that width's processes), then the final width runs to ``last``."""
    found: dict[int, tuple[str, str]] = {}
    ends = [end for end, _ in switches[1:]] + [last]
    for (_, nproc), end in zip(switches, ends):
        job = Job(_torchrun(nproc) + flags + ["--save", root, "--load", root, "--exit-interval", str(end)], forked=True)
        try:
            assert job.finish(RUN_SECONDS) == 0, job.output()[-3000:]
        finally:
            job.close()
        found.update(logged(job.lines))
    return found


def _run(make_test_hosts, tmp_path, tmp_path_factory, nproc: int, extra: list[str], cycles: int, seed: int):
    hosts, cache = make_test_hosts(2), session_cache(tmp_path_factory)
    flags = _flags(cache, *extra)
    replicas, rng = Replicas(hosts, nproc, flags), random.Random(seed)
    history, pauses, after = [], [], 0
    try:
        for _ in range(cycles):
            after += rng.randint(2, 9)
            alone, together, resumed = replicas.kill_and_rejoin(after)
            history.append((alone, together))
            pauses.append(resumed)
            after = together
        last = after + 3
        replicas.jobs[0].wait_for(rf"iteration\s+{last}/", RUN_SECONDS)
    finally:
        replicas.close()
    discarded = sum("is discarded" in line for line in replicas.jobs[0].lines)
    print(f"kills and rejoins (first iteration alone, first together again): {history}; seconds from each kill to "
          f"the survivor's next step: {[round(p, 1) for p in pauses]}; steps discarded: {discarded}")
    assert max(pauses) < RESUME_SECONDS, pauses
    assert discarded <= cycles  # at most the step under way at each kill
    survivor = {i: v for i, v in logged(replicas.jobs[0].lines).items() if i <= last}
    assert sorted(survivor) == list(range(1, last + 1))  # each iteration once: only the step under way was lost
    switches = [(0, 2 * nproc)] + [(edge - 1, n) for alone, together in history
                                   for edge, n in ((alone, nproc), (together, 2 * nproc))]
    return survivor, reference(flags, switches, last, str(tmp_path / "reference")), history


def test_ten_seeded_host_kills_cost_one_step_each_and_the_losses_of_the_switched_reference(
        make_test_hosts, tmp_path, tmp_path_factory):
    survivor, expected, _ = _run(make_test_hosts, tmp_path, tmp_path_factory, 1, [], cycles=10, seed=0)
    assert survivor == expected


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zbv"])
def test_a_pipeline_inside_each_replica_survives_a_host_kill(make_test_hosts, tmp_path, tmp_path_factory, schedule):
    batch = ["--global-batch-size", "16"] if schedule == "zbv" else []  # ZB-V needs m >= 3 at p = 2
    survivor, expected, _ = _run(make_test_hosts, tmp_path, tmp_path_factory, 2, layout_flags(1, 2, schedule) + batch,
                                 cycles=1, seed=1)
    assert survivor == expected


def test_zero3_inside_each_replica_survives_a_host_kill(make_test_hosts, tmp_path, tmp_path_factory):
    survivor, expected, history = _run(make_test_hosts, tmp_path, tmp_path_factory, 2,
                                       ["--data-parallel-sharding-strategy", "optim_grads_params"], cycles=1, seed=2)
    assert sorted(survivor) == sorted(expected)
    for iteration, (loss, norm) in survivor.items():
        assert float(loss) == pytest.approx(float(expected[iteration][0]), rel=1e-5), iteration
