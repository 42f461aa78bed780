"""The command-line tools, run as users run them: outputs that load, errors as one line without a traceback."""

import json
import os
import subprocess
import sys

import pytest

from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.tokenizer import build_tokenizer
from megapipe.errors import USAGE_ERROR
from launch_helpers import REPO as ROOT

pytestmark = pytest.mark.system

TEXTS = ["The first document. It is short.", "Another one, with a comma!", "Third: the last."]


def run_tool(name, *args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_train_tokenizer_then_preprocess(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t * 30}) + "\n" for t in TEXTS))
    trained = run_tool("train_tokenizer.py", "--input", str(corpus), "--kind", "bpe", "--vocab-size", "300",
                       "--output-prefix", str(tmp_path / "tok" / "bpe"))
    assert trained.returncode == 0, trained.stderr
    flags = trained.stdout.split()
    assert flags[:2] == ["--tokenizer-type", "GPT2BPETokenizer"] and "--merge-file" in flags
    done = run_tool("preprocess_data.py", "--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                    "--append-eod", "--no-progress", *flags)
    assert done.returncode == 0, done.stderr
    prefix = str(tmp_path / "out_text_document")
    assert done.stdout.strip() == f"text: {prefix}.bin / {prefix}.idx"
    tokenizer = build_tokenizer(**dict(zip([f[2:].replace("-", "_") for f in flags[::2]], flags[1::2])))
    ds = IndexedDataset(prefix, vocab_size=tokenizer.vocab_size)
    assert ds.format == "megatron"  # the default, so Megatron-LM reads it too
    assert [tokenizer.detokenize(ds.document(d)[:-1]) for d in range(3)] == [t * 30 for t in TEXTS]


def test_null_tokenizer_and_megapipe_output_format(tmp_path):
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["1 2 3", "49 0"]))
    done = run_tool("preprocess_data.py", "--input", str(corpus), "--output-prefix", str(tmp_path / "out"),
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--append-eod", "--no-progress",
                    "--output-format", "megapipe")
    assert done.returncode == 0, done.stderr
    ds = IndexedDataset(str(tmp_path / "out_text_document"), vocab_size=51)
    assert ds.format == "megapipe" and [ds.document(d).tolist() for d in range(2)] == [[1, 2, 3, 50], [49, 0, 50]]


def test_user_errors_are_one_line_without_traceback(tmp_path):
    missing = run_tool("preprocess_data.py", "--input", str(tmp_path / "none.jsonl"), "--output-prefix",
                       str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer")
    assert missing.returncode == USAGE_ERROR and "Traceback" not in missing.stderr
    assert missing.stderr.strip() == ("error: --tokenizer-type GPT2BPETokenizer needs --vocab-file "
                                      "(the GPT-2 vocab.json / encoder.json); pass its path.")
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    bad = run_tool("preprocess_data.py", "--input", str(tmp_path / "bad.jsonl"), "--output-prefix",
                   str(tmp_path / "out"), "--tokenizer-type", "ByteLevelTokenizer", "--no-progress")
    assert bad.returncode == USAGE_ERROR and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [f"error: {tmp_path / 'bad.jsonl'}:1 has no key 'text' (found: txt); "
                                               "pass the right field with --json-keys."]
    small = run_tool("train_tokenizer.py", "--input", str(tmp_path / "bad.jsonl"), "--json-key", "txt", "--kind",
                     "sentencepiece", "--vocab-size", "10", "--output-prefix", str(tmp_path / "sp"))
    assert small.returncode == USAGE_ERROR and small.stderr.startswith("error: SentencePiece cannot train a 10-piece")
    assert "Traceback" not in small.stderr
