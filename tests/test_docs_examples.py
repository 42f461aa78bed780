"""Every shell block the documentation marks runnable runs, shrunk to one iteration per training run,
and prints the lines its expected-output block lists (convention: docs/tests.md, "Runnable examples").

The blocks of one page run in order in one fresh working directory, so a later block can use what an
earlier one wrote (train, then resume or generate)."""

import contextlib
import pathlib

import pytest

from docs_example_helpers import (REPO, Command, forkable, run_block, runnable_blocks, shrunk, uses_slurm,
                                  working_directory)

PAGES = sorted(str(path.relative_to(REPO)) for path in pathlib.Path(REPO).glob("docs/*.md")) + ["README.md"]
RUNNABLE_PAGES = [page for page in PAGES if runnable_blocks(page, (pathlib.Path(REPO) / page).read_text())]


@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    """One cache of the tokenised embedded corpus for every page, as a user's ~/.cache/megapipe."""
    return str(tmp_path_factory.mktemp("megapipe-cache"))


# the Slurm testbed's nodes: two GPUs of a type each (links to /dev/null: the ranks run on the CPU)
SLURM_NODES = {"node1": {"fast": 2}, "node2": {"fast": 2}}


@contextlib.contextmanager
def slurm_for(blocks, directory: str):
    """The environment that sends a page's ``sbatch`` to a Slurm testbed of two nodes (its GPU count in
    place of the script's 8); nothing for a page without one, and a skip naming why Slurm cannot run."""
    if not any(uses_slurm(block) for block in blocks):
        yield {}
        return
    from megapipe.cluster.service.backends.slurm_testbed import SlurmTestbed, unavailable_reason

    if unavailable_reason():
        pytest.skip(unavailable_reason())
    with SlurmTestbed(directory, SLURM_NODES) as testbed:
        yield {"SLURM_CONF": testbed.conf, "SBATCH_GRES": "gpu:2"}


@pytest.mark.system
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_runnable_blocks_of_a_page_run_and_print_what_it_says(page, tmp_path, corpus_cache):
    cwd = working_directory(str(tmp_path / "work"))
    blocks = runnable_blocks(page, (pathlib.Path(REPO) / page).read_text())
    with slurm_for(blocks, str(tmp_path / "slurm")) as env:
        for block in blocks:
            run_block(block, cwd, corpus_cache, env)


@pytest.mark.system
def test_a_failing_command_or_a_missing_output_line_names_the_page_the_line_and_the_block(tmp_path):
    page = "\n".join(["# A page", "", "<!-- runnable -->", "```bash", "echo one", "false  # fails", "```",
                      "", "<!-- runnable -->", "```bash", "echo two", "```", "<!-- expected output -->", "```text",
                      "three", "```"])
    failing, mismatched = runnable_blocks("docs/page.md", page)
    cwd = working_directory(str(tmp_path / "work"))
    with pytest.raises(AssertionError, match=r"docs/page.md line 6 \(block docs/page.md:4\) failed with exit status 1"):
        run_block(failing, cwd, str(tmp_path))
    with pytest.raises(AssertionError, match=r"docs/page.md \(block docs/page.md:10\): expected output line 'three'"):
        run_block(mismatched, cwd, str(tmp_path))


@pytest.mark.unit
def test_training_commands_are_shrunk_to_one_iteration_and_others_run_as_written():
    assert shrunk("torchrun --nproc_per_node=2 pretrain_gpt.py --save ckpt   # later:") == \
        "torchrun --nproc_per_node=2 pretrain_gpt.py --save ckpt --exit-interval 1 --log-interval 1"
    assert shrunk("python tools/plot_schedule.py --schedule zbv -p 4") == "python tools/plot_schedule.py --schedule zbv -p 4"
    assert shrunk("sbatch --nodes 2 examples/train_gpt_slurm.sh -t 2  # one job") == \
        "sbatch --wait --nodes 2 examples/train_gpt_slurm.sh -t 2 --exit-interval 1 --log-interval 1"
    block = runnable_blocks("x.md", "<!-- runnable -->\n```bash\n# a comment\npython a.py \\\n    --b 1\n```\n")[0]
    assert block.commands == [Command(4, "python a.py      --b 1")]


@pytest.mark.unit
def test_the_first_run_a_newcomer_copies_is_among_the_tested_blocks():
    training = (pathlib.Path(REPO) / "docs" / "training.md").read_text()
    commands = [command.text for block in runnable_blocks("docs/training.md", training) for command in block.commands]
    assert "python pretrain_gpt.py" in commands and "docs/training.md" in RUNNABLE_PAGES


@pytest.mark.unit
def test_only_python_and_torchrun_commands_without_shell_syntax_are_forked():
    assert forkable('python tools/generate.py --prompt "The capital"  # a comment') == [
        "tools/generate.py", "--prompt", "The capital"]
    assert forkable("torchrun --nproc_per_node=2 pretrain_gpt.py") == [
        "-m", "torch.distributed.run", "--nproc_per_node=2", "pretrain_gpt.py"]
    for command in ("python -c 'print(1)' > out.txt", "python a.py $HOME", "bash tools/gpu_check.sh",
                    "python a.py && python b.py", "echo python"):
        assert forkable(command) is None, command


@pytest.mark.unit
def test_the_readme_is_a_road_map_of_three_runnable_next_steps_under_150_lines():
    """After the set-up: several processes (torchrun), your own data, several nodes (Slurm), each a tested block."""
    readme = (pathlib.Path(REPO) / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    road = readme[readme.index("## From a laptop to a cluster"):readme.index("## Documentation")]
    blocks = runnable_blocks("README.md", road)
    last_commands = [block.commands[-1].text.split()[0] for block in blocks]
    assert last_commands == ["torchrun", "python", "sbatch"], last_commands
    assert "--hf-dataset" in blocks[1].commands[-1].text
    assert readme.index("## From a laptop to a cluster") < readme.index("## Benchmarks at a glance") < \
        readme.index("## Reliability")
