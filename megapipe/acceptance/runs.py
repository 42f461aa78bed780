"""megapipe's own commands run from the acceptance steps as a user runs them: ``pretrain_gpt.py`` on
one process or under torchrun, and ``tools/generate.py``, several at once where they are independent
(one GPU holds them all; their start-up, mostly imports, overlaps)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Optional

from megapipe.acceptance.record import Context
from megapipe.training.logger import losses_in_log

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A GPT small enough to start in seconds and large enough that the GPU's kernels (not the host) run it.
GPU_MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512",
             "--micro-batch-size", "4", "--global-batch-size", "8"]
CPU_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "2", "--global-batch-size", "4"]
QUIET = ["--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1", "--lr", "1e-3",
         "--lr-warmup-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]
CHOSEN_BACKEND = re.compile(r"fusion backend:? (\w+) \((.*)\)\s*$", re.MULTILINE)


def model_flags(context: Context) -> list[str]:
    return (CPU_MODEL if context.dry_run else GPU_MODEL) + QUIET


def start(script: str, args: list[str], nproc: Optional[int] = None, env: Optional[dict] = None) -> subprocess.Popen:
    """``script`` (relative to the checkout) started with ``args``, under torchrun when ``nproc`` is given."""
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.Popen(launcher + [os.path.join(REPO, script)] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, **(env or {})))


class Finished:
    """A command's exit code and output, with what the checks read from it."""

    def __init__(self, what: str, process: subprocess.Popen, timeout: Optional[float] = None):
        self.what, self.timed_out = what, False
        try:
            self.stdout, self.stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            self.stdout, self.stderr = process.communicate()
            self.timed_out = True
        self.returncode = process.returncode
        print(f"--- {what}: exit {self.returncode}\n{self.stdout[-3000:]}{self.stderr[-3000:]}", flush=True)

    def succeeded(self) -> None:
        """Raise naming the command and its last error line unless it exited 0."""
        if self.timed_out:
            raise AssertionError(f"{self.what} did not finish in its time")
        if self.returncode != 0:
            errors = [line for line in self.stderr.splitlines() if line.strip()]
            said = next((line for line in reversed(errors) if line.startswith("error:")), errors[-1] if errors else "")
            raise AssertionError(f"{self.what} exited {self.returncode}: {said.strip()[:300]}")

    def losses(self) -> dict[int, float]:
        return losses_in_log(self.stdout)

    def backend(self) -> tuple[str, str]:
        """(fusion backend, the reason) from the start-up line."""
        found = CHOSEN_BACKEND.search(self.stdout + self.stderr)
        return (found[1], found[2]) if found else ("?", "no start-up line")


def run_together(commands: dict[str, tuple]) -> dict[str, Finished]:
    """Start every ``name: (script, args[, nproc[, env]])`` at once; wait for all."""
    started = {name: start(*spec) for name, spec in commands.items()}
    return {name: Finished(name, process) for name, process in started.items()}


def falling(losses: dict[int, float], iterations: int) -> str:
    """The losses of iterations 1..``iterations`` exist, are finite and fall: the mean of the last
    three is under 90% of the first (from the data's ~5.5 nats a model that learns is far below)."""
    assert sorted(losses) == list(range(1, iterations + 1)), f"iterations logged: {sorted(losses)}"
    last = sum(losses[i] for i in range(iterations - 2, iterations + 1)) / 3
    assert last < 0.9 * losses[1], f"losses did not fall: {losses[1]:.4f} at 1, {last:.4f} at the end"
    return f"loss {losses[1]:.3f} -> {losses[iterations]:.3f}"
