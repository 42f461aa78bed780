"""A flag given takes effect or is refused, never ignored: tokenizer flags without --data-path tokenise the
embedded corpus, file flags belong to the tokenizer they name, and a flag the run's path does not read is
refused in one sentence (or, for flags Megatron-LM's scripts pass by habit, noted once)."""

from __future__ import annotations

import pytest

from data_helpers import gpt2_files
from megapipe.cli.parse import parse_config
from megapipe.data.corpus import corpus_paragraphs
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.rank_data import check_tokenizer_flags, run_tokenizer
from megapipe.data.rank_data import _tokenizer_and_path
from megapipe.errors import ConfigError

pytestmark = pytest.mark.unit


def _refusal(argv: list[str], kind: str = "gpt") -> str:
    with pytest.raises(ConfigError) as error:
        check_tokenizer_flags(parse_config(kind, argv))
    text = str(error.value)
    assert text.count(". ") == 0 and text.endswith("."), text  # one sentence
    return text


def test_gpt2_bpe_flags_without_data_path_tokenise_the_embedded_corpus(tmp_path, monkeypatch):
    """The corpus in GPT-2's tokens: the run's vocabulary is GPT-2's, and the dataset decodes to the
    paragraphs the byte-level default reads (GPT-2's BPE is lossless on them)."""
    monkeypatch.setenv("MEGAPIPE_CACHE", str(tmp_path))
    vocab, merges = gpt2_files()
    config = parse_config("gpt", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                  "--merge-file", merges])
    check_tokenizer_flags(config)
    tokenizer, [prefix] = _tokenizer_and_path("gpt", config)
    assert tokenizer.name == "GPT2BPETokenizer" and tokenizer.vocab_size == 50257
    dataset = IndexedDataset(prefix)
    eod = tokenizer.special_id("eod")
    first = [int(t) for t in dataset[0]]
    assert first[-1] == eod and tokenizer.detokenize(first[:-1]) == corpus_paragraphs()[0]
    default, [default_prefix] = _tokenizer_and_path("gpt", parse_config("gpt", []))
    assert default.vocab_size == 261 and default_prefix != prefix  # each tokenizer has its own cache
    assert run_tokenizer("gpt", config).vocab_size == 50257


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"],
     "--tokenizer-model gpt2 does not exist; pass the path of a tokenizer.json or a folder holding one (megapipe "
     "reads local files only"),
    (["--vocab-file", "vocab.json"], "--vocab-file is read by --tokenizer-type GPT2BPETokenizer or "
                                     "BertWordPieceLowerCase or BertWordPieceCase only and no --tokenizer-type is given"),
    (["--tokenizer-type", "ByteLevelTokenizer", "--merge-file", "merges.txt"],
     "--merge-file is read by --tokenizer-type GPT2BPETokenizer only and --tokenizer-type ByteLevelTokenizer does "
     "not read it"),
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
     "--tokenizer-type NullTokenizer reads text made of decimal token ids, and the embedded corpus is prose"),
    (["--mock-data", "--vocab-size", "100", "--tokenizer-type", "ByteLevelTokenizer"],
     "--mock-data draws random token ids below --vocab-size and reads no tokenizer"),
])
def test_tokenizer_flags_the_run_would_not_read_are_refused_before_any_process_group(argv, message):
    assert _refusal(argv).startswith(message)


@pytest.mark.parametrize("kind, argv, message", [
    ("gpt", ["--mask-prob", "0.2"], "--mask-prob 0.2 is read only by pretrain_bert.py's masked language model"),
    ("gpt", ["--hf-dataset-text-key", "body"], "--hf-dataset-text-key body is read only with --hf-dataset"),
    ("gpt", ["--finetune"], "--finetune is read only with --load DIR, so this run would ignore it; add --load"),
    ("bert", ["--no-load-rng"], "--no-load-rng is read only with --load DIR"),
    ("gpt", ["--non-finite-action", "skip"], "--non-finite-action skip is read only with "
                                             "--check-for-nan-in-loss-and-grad"),
    ("gpt", ["--bert-no-binary-head"], "--bert-no-binary-head is read only by pretrain_bert.py's sentence-order head"),
    ("gpt", ["--moe-router-topk", "4"], "--moe-router-topk 4 is read only with --num-experts N (a mixture-of-experts "
                                        "model), so this run would ignore it; add --num-experts or drop the flag"),
    ("gpt", ["--moe-grouped-gemm"], "--moe-grouped-gemm is read only with --num-experts N"),
    ("gpt", ["--expert-tensor-parallel-size", "1"], "--expert-tensor-parallel-size 1 is read only with --num-experts"),
])
def test_a_changed_flag_the_run_would_not_read_is_one_sentence(kind, argv, message):
    with pytest.raises(ConfigError) as error:
        parse_config(kind, argv)
    text = str(error.value)
    assert text.startswith(message) and text.count(". ") == 0 and text.endswith("."), text


def test_flags_megatron_scripts_pass_by_habit_are_noted_once_and_the_run_goes_on(capsys):
    parse_config("gpt", ["--num-workers", "8", "--override-opt-param-scheduler", "--wandb-exp-name", "x",
                         "--async-save", "--cp-comm-type", "a2a"])
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == ["note: --cp-comm-type a2a is read only with --context-parallel-size above 1, so this run would "
                     "ignore it (one context rank exchanges nothing)",
                     "note: --num-workers 8 is read only with --hf-dataset, so this run would ignore it (other data "
                     "is read from memory-mapped files in the training process)",
                     "note: --override-opt-param-scheduler is read only with --load DIR, so this run would ignore it "
                     "(a run that starts afresh follows the flags' schedule anyway)",
                     "note: --async-save is read only with --save DIR, so this run would ignore it (nothing is "
                     "saved without it)",
                     "note: --wandb-exp-name x is read only with --wandb-project, so this run would ignore it "
                     "(nothing goes to Weights & Biases without it)"]
    parse_config("gpt", ["--num-workers", "2", "--finetune", "--load", "x", "--save", "x"])  # defaults, or read
    parse_config("gpt", ["--mock-data", "--vocab-size", "10"])  # --split's derived default is no flag given
    parse_config("gpt", ["--num-experts", "2", "--moe-router-topk", "1", "--disable-bias-linear"])  # read
    parse_config("bert", ["--bert-no-binary-head"])
    assert "note:" not in capsys.readouterr().err
