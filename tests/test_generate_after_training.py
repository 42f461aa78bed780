"""A user's first hour: train with pretrain_gpt.py, generate text from the checkpoint, export it to
Hugging Face and get the same text from transformers.

``pretrain_gpt.py --save`` (byte-level tokenizer of the embedded corpus) runs once as a process of its own
(forked from a server that has imported torch, as ``tools/generate.py``'s runs: ``megapipe.testing.forked``); ``tools/generate.py`` prints text from it, for ``--prompt`` and ``--prompt-ids`` alike. The export loads in
``AutoModelForCausalLM`` and ``AutoTokenizer``, tokenizes the prompt to megapipe's ids and greedy
generation gives the same text. A checkpoint saved before checkpoints carried tokenizers gets one
sentence naming the tokenizer flags, and works with them.
"""

import importlib.util
import json
import os
import shutil

import pytest
import torch
import transformers
from test_training_cli import ROOT, TINY, run

from megapipe.checkpointing.common import SavedLayout
from megapipe.checkpointing.convert import export_hf_checkpoint, reshard
from megapipe.checkpointing.paths import COMMON, find_checkpoint
from megapipe.checkpointing.tokenizer_files import TOKENIZER_DIR
from megapipe.testing.forked import run_script

pytestmark = pytest.mark.system

PROMPT, NEW = "The", 8


def _generate(checkpoint, *flags):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return run_script([os.path.join(ROOT, "tools", "generate.py"), "--load", str(checkpoint), "--max-new-tokens",
                       str(NEW), "--greedy", *flags], env, os.getcwd(), timeout=120)


def _generate_tool():
    spec = importlib.util.spec_from_file_location("generate", os.path.join(ROOT, "tools", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("first-hour")
    result = run(TINY + ["--train-iters", "2", "--save", str(root / "ck")], cache=root)
    assert result.returncode == 0, result.stderr
    done = _generate(root / "ck", "--prompt", PROMPT, "--prompt-ids", " ".join(map(str, PROMPT.encode())))
    assert done.returncode == 0, done.stderr
    half = len(done.stdout) // 2  # one line per prompt; a generated text may hold newlines itself
    assert done.stdout[:half] == done.stdout[half:]  # --prompt-ids output is text too when there is a tokenizer
    return root, done.stdout[:half].removesuffix("\n")


def test_generate_prints_text_and_transformers_continues_the_export_alike(trained):
    root, printed = trained
    assert printed.startswith(PROMPT) and len(printed.encode()) > len(PROMPT), printed
    export_hf_checkpoint(str(root / "ck"), str(root / "hf"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == list(PROMPT.encode())  # megapipe's byte-level ids
    assert model.config.eos_token_id == tokenizer.eos_token_id == 256 < model.config.vocab_size
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    assert tokenizer.decode(out[0], skip_special_tokens=True) == printed


def test_reshard_keeps_the_tokenizer(trained, tmp_path):
    root, _ = trained
    reshard(str(root / "ck"), str(tmp_path / "p2"), SavedLayout(1, 2, 1))
    with open(os.path.join(find_checkpoint(str(tmp_path / "p2")), COMMON)) as f:
        assert json.load(f)["tokenizer"] == {"tokenizer_type": "ByteLevelTokenizer"}


def test_prompt_on_a_checkpoint_without_tokenizer_names_the_flags(trained, tmp_path, capsys):
    root, printed = trained
    old = tmp_path / "old"
    shutil.copytree(find_checkpoint(str(root / "ck")), old)
    shutil.rmtree(old / TOKENIZER_DIR, ignore_errors=True)
    common = json.loads((old / COMMON).read_text())
    del common["tokenizer"]  # as checkpoints were written before they carried tokenizers
    (old / COMMON).write_text(json.dumps(common))
    assert _generate_tool().main(["--load", str(old), "--prompt", PROMPT]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith(f"error: --prompt needs a tokenizer, and {old} carries none")
    assert "pass the tokenizer flags it was trained with, e.g. --tokenizer-type ByteLevelTokenizer" in error
    done = _generate(old, "--prompt", PROMPT, "--tokenizer-type", "ByteLevelTokenizer")
    assert done.returncode == 0, done.stderr
    assert done.stdout.removesuffix("\n") == printed


def test_generation_refuses_context_parallelism_in_one_sentence(trained, capsys):
    """Generation, the server and evaluation load through one function, which refuses c > 1 before any group."""
    root, _ = trained
    assert _generate_tool().main(["--load", str(root / "ck"), "--prompt", PROMPT, "--context-parallel-size", "2"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and error.startswith("error: --context-parallel-size 2 is for training")
