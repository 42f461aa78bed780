"""Every shell example of the documentation runs offline as written or says what it needs: a shell block
of docs/*.md is either marked runnable (tests/test_docs_examples.py runs it on one CPU machine, with what
the repository ships or makes) or opens with a ``# Needs: ...`` line naming what it needs that the test
does not have (GPT-2's files, a Megatron-LM checkpoint, GPUs, several machines, a Slurm cluster, a
service left running). Convention: docs/tests.md, "Runnable examples"."""

import pathlib
import re

import pytest

from docs_example_helpers import REPO, RUNNABLE, fences, needs_line, shell_blocks

PAGES = sorted(str(path.relative_to(REPO)) for path in pathlib.Path(REPO).glob("docs/*.md"))
# The first word of a command: a fence that opens with one is a shell block and must say so (output that
# shows a command further down, as tools/plan.py's, is not).
COMMAND = re.compile(r"(python|python3|torchrun|bash|sudo|srun|sbatch|curl|pip|mkdocs|export)\s|#SBATCH\s")


def _page(page: str) -> str:
    return (pathlib.Path(REPO) / page).read_text()


@pytest.mark.unit
@pytest.mark.parametrize("page", PAGES)
def test_every_shell_block_is_runnable_or_says_what_it_needs(page):
    silent = [f"{page}:{block.line}" for block in shell_blocks(_page(page))
              if block.marker != RUNNABLE and needs_line(block) is None]
    assert not silent, (f"shell blocks neither marked {RUNNABLE} nor opening with a '# Needs: ...' line: "
                        f"{', '.join(silent)}; make each runnable offline, or say in its first line what it "
                        "needs that is not shipped (docs/tests.md, Runnable examples)")


@pytest.mark.unit
@pytest.mark.parametrize("page", PAGES)
def test_a_runnable_block_does_not_also_say_it_needs_something(page):
    both = [f"{page}:{block.line}" for block in shell_blocks(_page(page))
            if block.marker == RUNNABLE and needs_line(block) is not None]
    assert not both, f"runnable blocks with a '# Needs:' line (the test runs them, so they need nothing): {both}"


@pytest.mark.unit
@pytest.mark.parametrize("page", PAGES)
def test_commands_are_in_fences_that_name_a_shell(page):
    """A fence with no language (or ``text``) that opens with a command would escape the check above."""
    unnamed = [f"{page}:{fence.line}" for fence in fences(_page(page))
               if fence.language in ("", "text") and fence.body and COMMAND.match(fence.body[0])]
    assert not unnamed, f"fences holding commands without a shell language (write ```bash): {unnamed}"


@pytest.mark.unit
def test_blocks_are_found_by_language_and_the_needs_line_is_the_first_line():
    page = "\n".join([
        "<!-- runnable -->", "```bash", "python pretrain_gpt.py", "```",
        "```sh", "# Needs: 8 GPUs", "torchrun --nproc_per_node=8 pretrain_gpt.py", "```",
        "```console", "python tools/generate.py --load ckpt/", "# Needs: too late, not the first line", "```",
        "```text", "iteration 1/500", "```",
        "````markdown", "```bash", "echo inside an example of the convention", "```", "````",
        "```python", "import megapipe", "```"])
    blocks = shell_blocks(page)
    assert [(block.line, block.language) for block in blocks] == [(2, "bash"), (5, "sh"), (9, "console")]
    assert [block.marker == RUNNABLE for block in blocks] == [True, False, False]
    assert [needs_line(block) for block in blocks] == [None, "Needs: 8 GPUs", None]
    assert [fence.language for fence in fences(page)] == ["bash", "sh", "console", "text", "markdown", "python"]
