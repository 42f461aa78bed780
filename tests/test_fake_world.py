"""Every parallel dimension at real layer shapes in one process: ``benchmarks/bench_fake_world.py --quick`` runs
rank 0's training steps of a world of 8 on PyTorch's fake process group and fake tensors (t = 8 with sequence
parallelism, t = 4 with c = 2, ZeRO-1 and ZeRO-3 at d = 8, Mixtral-shaped experts at e = 8) and reports each
one's device memory next to the planner's; a fake world the layouts do not divide is refused in one sentence.
In a process of its own: the fake process group would otherwise be this process's default group."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.system
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "bench_fake_world.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, "--quick", *args], capture_output=True, text=True, timeout=600,
                          cwd=REPO)


def test_rank_zero_of_a_world_of_eight_trains_every_dimension_on_fake_tensors():
    result = run()
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (.+?) \| ([0-9.]+) \| ([0-9.]+) \| \*\*([0-9.]+)\*\*", result.stdout, re.MULTILINE)
    assert [row[0] for row in rows] == ["GPT-1.3B, t = 8, sequence parallel", "GPT-1.3B, t = 4, c = 2 (ring)",
                                        "GPT-1.3B, d = 8, ZeRO-1", "GPT-1.3B, d = 8, ZeRO-3",
                                        "2 Mixtral layers, e = 8, grouped experts"]
    peaks = {name: float(peak) for name, peak, _, _ in rows}
    # t = 8 holds an eighth of the weights and of the sequence-parallel activations: less than t = 4 with c = 2
    assert 0 < peaks["GPT-1.3B, t = 8, sequence parallel"] < peaks["GPT-1.3B, t = 4, c = 2 (ring)"]
    # ZeRO-3 frees the gathered weights between and within passes (storages resized to 0): less than ZeRO-1
    assert peaks["GPT-1.3B, d = 8, ZeRO-3"] < peaks["GPT-1.3B, d = 8, ZeRO-1"]
    # the planner's memory model (selective recomputation, flash attention, fused AdamW) within the 15%
    # of what the dense layouts hold; even with two layers, where the logits weigh more than at 24
    ratios = {name: float(ratio) for name, _, _, ratio in rows}
    assert all(0.85 <= ratios[name] <= 1.15 for name in ratios if name.startswith("GPT")), ratios


def test_a_world_the_layouts_do_not_divide_is_one_sentence():
    result = run("--world-size", "6", "--cases", "tp8")
    assert result.returncode == 2
    assert "error: GPT-1.3B, t = 8, sequence parallel cannot run in a fake world of 6: world size 6 is not " \
           "divisible by --tensor-model-parallel-size 8" in result.stdout
