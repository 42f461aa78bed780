"""``tools/eval_harness.py`` runs lm-evaluation-harness on the repository's local tasks
(examples/eval_tasks) as users run it, plain and under torchrun (the script, or torchrun, forked from a
server that has imported torch: ``megapipe.testing.forked``).

A GPT-2 with random weights (spread wide, so no near-tie decides a greedy token) is imported and
read with megapipe's byte-level tokenizer: at (t, p) = (2, 2) every example's log-likelihoods are
those of (1, 1) to 1e-5 relative (the same fp32 maths, reduced in another order across tensor
ranks, as in test_hf_equivalence) and the greedy generations are the same. An imported Hugging
Face Llama scores each request as transformers' log-softmax sums over the same tokens. An unknown
task and a missing checkpoint are one sentence each and exit 2.
"""

import json
import os
import sys

import pytest
import torch
import transformers
from launch_helpers import Job, standalone
from server_helpers import ROOT, tiny_checkpoint

from megapipe.checkpointing.common import SavedLayout
from megapipe.checkpointing.convert import import_hf_checkpoint
from megapipe.testing.forked import run_script

pytestmark = pytest.mark.system

RTOL = 1e-5
TOOL = os.path.join(ROOT, "tools", "eval_harness.py")
TASKS = ["--tasks", "megapipe_tiny_mc,megapipe_tiny_gen", "--include-path", os.path.join("examples", "eval_tasks")]


def evaluate(checkpoint, output, *flags, nproc=None):
    """The tool's run (from the repository root, as the task files expect) and its JSON results; its
    processes are killed as a group if it outlives its deadline."""
    argv = [TOOL, "--load", str(checkpoint), *TASKS, "--output-path", str(output), *flags]
    job = Job([sys.executable, *argv] if nproc is None else standalone(nproc, argv), forked=True)
    try:
        code = job.finish(240)
    finally:
        job.close()
    assert code == 0, job.output()[-3000:]
    assert "megapipe_tiny_mc" in job.output() and "acc" in job.output(), job.output()  # lm_eval's table
    with open(output) as f:
        return json.load(f)["samples"]


def loglikelihoods(samples):
    """Every multiple-choice request's ((context, continuation), log-likelihood), in lm_eval's order."""
    return [(tuple(args), resp[0][0]) for s in samples["megapipe_tiny_mc"]
            for args, resp in zip(s["arguments"], s["resps"])]


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-gpt")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=264, n_positions=64, initializer_range=0.3,
        bos_token_id=256, eos_token_id=256))  # the byte-level end-of-text
    model.save_pretrained(root / "hf")
    import_hf_checkpoint(str(root / "hf"), str(root / "ckpt"), SavedLayout(1, 1, 1))
    return root


def test_2x2_layout_gives_the_single_process_loglikelihoods_and_generations(gpt):
    tokenizer = ["--tokenizer-type", "ByteLevelTokenizer"]  # the import carries no tokenizer
    single = evaluate(gpt / "ckpt", gpt / "single.json", *tokenizer)
    split = evaluate(gpt / "ckpt", gpt / "split.json", *tokenizer, "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "2", nproc=4)
    expected, actual = loglikelihoods(single), loglikelihoods(split)
    assert len(expected) == 18 and [a for a, _ in actual] == [a for a, _ in expected]
    torch.testing.assert_close(torch.tensor([x for _, x in actual]), torch.tensor([x for _, x in expected]),
                               rtol=RTOL, atol=0)
    generated = [s["resps"] for s in single["megapipe_tiny_gen"]]
    assert generated == [s["resps"] for s in split["megapipe_tiny_gen"]]
    assert any(text[0][0] for text in generated)  # something was generated, not only cut at a stop string


def test_imported_llama_scores_as_transformers(tmp_path):
    model, checkpoint = tiny_checkpoint(tmp_path)
    samples = evaluate(checkpoint, tmp_path / "llama.json")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    requests = loglikelihoods(samples)
    assert len(requests) == 18
    for (context, continuation), loglikelihood in requests:
        ids = tokenizer(context + continuation)["input_ids"]
        start = len(tokenizer(context)["input_ids"])
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        expected = sum(logprobs[i - 1, ids[i]].item() for i in range(start, len(ids)))
        assert loglikelihood == pytest.approx(expected, rel=RTOL), (context, continuation)


@pytest.mark.parametrize("flags, message", [
    (["--tasks", "no_such_task", "--include-path", os.path.join("examples", "eval_tasks")],
     "--tasks no_such_task is no lm_eval task"),
    (["--tasks", "megapipe_tiny_mc", "--include-path", os.path.join("examples", "eval_tasks")],
     "does not exist"),
])
def test_bad_input_is_one_sentence(tmp_path, flags, message):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = run_script([TOOL, "--load", str(tmp_path / "missing"), *flags], env, ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
