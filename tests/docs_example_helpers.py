"""The runnable examples of the documentation: how they are marked, found, shrunk and run.

A shell block preceded by ``<!-- runnable -->`` is run; a block preceded by
``<!-- expected output -->`` right after it lists lines its output must contain. A shell block that
is not run opens with a ``# Needs: ...`` line saying what it needs beyond what a runnable block gets.
docs/tests.md describes the convention for writers."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from launch_helpers import REPO

from megapipe.testing.forked import run_script

RUNNABLE = "<!-- runnable -->"
EXPECTED = "<!-- expected output -->"
SHELL_LANGUAGES = ("bash", "sh", "shell", "console", "zsh")
NEEDS = re.compile(r"# Needs: \S")  # the first line of a shell block that is not run: what it needs
TRAINING_SCRIPT = re.compile(r"\bpretrain_(gpt|bert)\.py\b")
SBATCH = re.compile(r"sbatch\s+")
SHRINK_FLAGS = "--exit-interval 1 --log-interval 1"  # one iteration, saved when --save is given, then exit
COMMAND_SECONDS = 180


@dataclass
class Command:
    line: int  # where it starts in the page
    text: str


@dataclass
class Block:
    page: str
    line: int  # of its opening fence
    commands: list[Command]
    expected: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Fence:
    line: int  # of its opening fence
    language: str  # the fence's info string ("bash", "text"), "" when none
    marker: str  # the line right above the fence, stripped
    body: list[str]


def fences(text: str) -> list[Fence]:
    """Every fenced block of a page; a block opened with more backticks may hold fences of fewer
    (as docs/tests.md's example of the convention)."""
    lines, found, index = text.splitlines(), [], 0
    while index < len(lines):
        opening = re.match(r"(`{3,})\s*([^`\s]*)", lines[index])
        if opening:
            start = index
            index += 1
            while lines[index].strip() != opening.group(1):
                index += 1
            found.append(Fence(start + 1, opening.group(2).lower(), lines[start - 1].strip() if start else "",
                               lines[start + 1:index]))
        index += 1
    return found


def shell_blocks(text: str) -> list[Fence]:
    """The page's shell blocks (bash, sh, shell, console): the examples a reader copies into a terminal."""
    return [fence for fence in fences(text) if fence.language in SHELL_LANGUAGES]


def needs_line(fence: Fence) -> str | None:
    """What a block that is not run needs, from its first line ``# Needs: ...``; None when it has no such line."""
    first = fence.body[0].strip() if fence.body else ""
    return first[len("# "):] if NEEDS.match(first) else None


def _commands(first_line: int, body: list[str]) -> list[Command]:
    """The block's commands: continuation lines joined, blank and comment-only lines left out."""
    commands, pending, start = [], "", 0
    for offset, text in enumerate(body):
        if not pending:
            start = first_line + 1 + offset
            if not text.strip() or text.lstrip().startswith("#"):
                continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        commands.append(Command(start, pending + text))
        pending = ""
    return commands


def runnable_blocks(page: str, text: str) -> list[Block]:
    """The page's runnable blocks in order, each with the expected-output block that follows it."""
    blocks: list[Block] = []
    previous_runnable = False
    for fence in fences(text):
        if fence.marker == RUNNABLE:
            blocks.append(Block(page, fence.line, _commands(fence.line, fence.body)))
        elif fence.marker == EXPECTED:
            if not previous_runnable:
                raise AssertionError(f"{page}:{fence.line}: an expected-output block must follow a runnable block")
            blocks[-1].expected = [" ".join(text.split()) for text in fence.body if text.strip()]
        previous_runnable = fence.marker == RUNNABLE
    return blocks


def shrunk(command: str) -> str:
    """The command as the test runs it: a training run gets SHRINK_FLAGS (after its own, before a comment);
    so does a Slurm batch script (its arguments are the training flags), submitted with ``--wait``."""
    without_comment = re.sub(r"\s+#\s.*$", "", command)
    if SBATCH.match(command):
        return f"{SBATCH.sub('sbatch --wait ', without_comment, count=1)} {SHRINK_FLAGS}"
    if not TRAINING_SCRIPT.search(command):
        return command
    return f"{without_comment} {SHRINK_FLAGS}"


def uses_slurm(block: Block) -> bool:
    """Whether the block submits a Slurm job (the test gives it a Slurm testbed)."""
    return any(SBATCH.match(command.text) for command in block.commands)


def _slurm_log(output: str, cwd: str) -> str:
    """The log of the batch job ``sbatch --wait`` reported submitting (Slurm's default slurm-JOBID.out)."""
    submitted = re.search(r"Submitted batch job (\d+)", output)
    path = os.path.join(cwd, f"slurm-{submitted.group(1)}.out") if submitted else None
    return open(path).read() if path and os.path.exists(path) else ""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def working_directory(path: str) -> str:
    """A fresh directory where the repository's entry points and folders appear as in a checkout."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(REPO):
        if not name.startswith("."):
            os.symlink(os.path.join(REPO, name), os.path.join(path, name))
    return path


def forkable(command: str) -> list[str] | None:
    """``python ...`` or ``torchrun ...`` with no shell syntax but quotes: the argv ``megapipe.testing.forked`` runs
    (the script, or torchrun, forked from a server that has imported torch: seconds sooner than through bash and a
    new interpreter, the same run); None for any other command, which bash runs."""
    if re.search(r"[|&;<>()$`*?~{}\\!]", command):
        return None
    argv = shlex.split(command, comments=True)
    if argv and argv[0] == "python":
        return argv[1:]
    if argv and argv[0] == "torchrun":
        return ["-m", "torch.distributed.run", *argv[1:]]
    return None


def run_block(block: Block, cwd: str, cache: str, env_extra: dict | None = None) -> None:
    """Run the block's commands in ``cwd`` (with ``env_extra``, e.g. a Slurm testbed's ``SLURM_CONF``); fail
    naming the page, the line and the block. A batch job's log counts as its ``sbatch``'s output."""
    env = dict(os.environ, PYTHONPATH=REPO, MEGAPIPE_CACHE=cache, MEGAPIPE_DEVICE="cpu", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), **(env_extra or {}))
    output = ""
    for command in block.commands:
        env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's port, so parallel test runs do not collide
        argv = forkable(shrunk(command.text))
        try:
            if argv is not None:
                done = run_script(argv, env, cwd, COMMAND_SECONDS, merge_errors=True)
            else:
                done = subprocess.run(["bash", "-c", shrunk(command.text)], cwd=cwd, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=COMMAND_SECONDS)
        except subprocess.TimeoutExpired as error:
            raise AssertionError(f"{block.page} line {command.line} (block {block.name}) ran past "
                                 f"{COMMAND_SECONDS} s: {command.text}\n{error.output or ''}") from None
        output += done.stdout + (_slurm_log(done.stdout, cwd) if SBATCH.match(command.text) else "")
        if done.returncode:
            raise AssertionError(f"{block.page} line {command.line} (block {block.name}) failed with exit status "
                                 f"{done.returncode}: {command.text}\n{output[-3000:]}")
    seen = " ".join(output.split())
    for line in block.expected:
        if line not in seen:
            raise AssertionError(f"{block.page} (block {block.name}): expected output line {line!r} is not in its "
                                 f"output any more\n{output[-3000:]}")
