"""Tokenizers: real GPT-2 and SentencePiece vocabularies, round trips, special tokens, flag errors."""

import importlib.util
import json
import pickle

import pytest

from data_helpers import gpt2_files, mistral_sentencepiece_model, package_file
from megapipe.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megapipe.data.tokenizer.training import train_bpe, train_sentencepiece, train_wordpiece
from megapipe.errors import ConfigError, DataError

pytestmark = pytest.mark.unit

TRICKY_TEXTS = [
    "Hello world",
    "  leading spaces, trailing tab\t",
    "line one\n\nline three\r\nwindows",
    "Unicode: héllo wörld, Ελληνικά, 日本語, emoji 🎉👍🏽",
    "text that spells <|endoftext|> and [CLS] literally",
    "",
]
SAMPLE_CORPUS = ["The quick brown fox jumps over the lazy dog. " * 20,
                 "A tokenizer maps text to integers and back again. " * 20,
                 "Pack my box with five dozen liquor jugs! " * 20]


@pytest.fixture(scope="module")
def gpt2():
    vocab, merges = gpt2_files()
    return build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)


def test_byte_level_is_lossless_and_has_bert_specials():
    tok = build_tokenizer("ByteLevelTokenizer")
    for text in TRICKY_TEXTS:
        ids = tok.tokenize(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.detokenize(ids) == text
    specials = [tok.eod, tok.cls, tok.sep, tok.mask, tok.pad]
    assert len(set(specials)) == 5 and min(specials) >= 256 and max(specials) < tok.vocab_size == 261
    assert tok.detokenize([tok.cls, 104, 105, tok.sep]) == "hi"
    assert tok.detokenize([0xFF, 104]) == "\ufffdh"  # invalid UTF-8 from a model is replaced, not raised
    assert tok.lossless


def test_gpt2_bpe_matches_openai_ids(gpt2):
    assert gpt2.tokenize("Hello world") == [15496, 995]
    assert gpt2.eod == 50256
    assert gpt2.vocab_size == 50257
    assert gpt2.lossless


def test_gpt2_bpe_round_trips_every_text(gpt2):
    for text in TRICKY_TEXTS:
        assert gpt2.detokenize(gpt2.tokenize(text)) == text
    # the literal string is ordinary text, never the eod id
    assert gpt2.eod not in gpt2.tokenize("<|endoftext|>")


def test_gpt2_has_no_bert_tokens(gpt2):
    with pytest.raises(ConfigError, match=r"\[CLS\].*BertWordPiece"):
        gpt2.cls


def test_tokenizers_pickle_as_their_build_arguments(gpt2):
    clone = pickle.loads(pickle.dumps(gpt2))
    assert clone is not gpt2 and clone.tokenize(TRICKY_TEXTS[3]) == gpt2.tokenize(TRICKY_TEXTS[3])
    assert len(pickle.dumps(gpt2)) < 1000  # the files are re-read, the tables are not shipped


def test_sentencepiece_model_from_mistral():
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=mistral_sentencepiece_model())
    assert tok.vocab_size == 32000
    assert tok.eod == 2  # </s>
    for text in ["Hello world", "The quick brown fox, 42 times.", "héllo wörld 日本語"]:
        ids = tok.tokenize(text)
        assert 0 < len(ids) < len(text.encode()) and max(ids) < 32000
        assert tok.detokenize(ids) == text
    with pytest.raises(ConfigError, match=r"\[MASK\]"):
        tok.mask


def test_megatron_sentencepiece_types_differ_from_the_plain_one_as_megatrons_do():
    """GPTSentencePieceTokenizer: the model's ids, eod = eos, no BERT roles; Llama2Tokenizer: bos first."""
    import sentencepiece

    model = mistral_sentencepiece_model()
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=model)
    for tok in (gpt, llama):
        assert (tok.vocab_size, tok.eod, tok.special_id("pad")) == (32000, processor.eos_id(), None)
        assert all(tok.special_id(role) is None for role in ("cls", "sep", "mask"))
        assert pickle.loads(pickle.dumps(tok)).tokenize("Hello world") == tok.tokenize("Hello world")
    for text in ["Hello world", "héllo wörld 日本語", ""]:
        assert gpt.tokenize(text) == processor.encode(text)
        assert llama.tokenize(text) == [processor.bos_id()] + processor.encode(text) and processor.bos_id() == 1
        assert llama.detokenize(llama.tokenize(text)) == gpt.detokenize(gpt.tokenize(text)) == text
    assert (gpt.name, llama.name) == ("GPTSentencePieceTokenizer", "Llama2Tokenizer")


def megatron_null_tokenizer_class():
    """megatron-core's NullTokenizer, loaded from its file alone (the package's __init__ takes seconds)."""
    path = package_file("megatron", "core", "tokenizers", "text", "libraries", "null_tokenizer.py")
    spec = importlib.util.spec_from_file_location("megatron_null_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NullTokenizer


def test_null_tokenizer_is_megatrons():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tok.vocab_size, tok.eod, tok.special_ids) == (101, 100, frozenset({100}))
    assert tok.tokenize("3 14\t15\n 92") == [3, 14, 15, 92] and tok.detokenize([3, 14, 100]) == "3 14 100"
    core = megatron_null_tokenizer_class()(100)
    assert (core.vocab_size, core.eod, core.text_to_ids("3 14 15 92")) == (101, 100, [3, 14, 15, 92])
    for text in ("3 x 5", "100", "-1"):
        with pytest.raises(DataError, match=f"NullTokenizer reads token ids 0 to 99 written as decimal numbers "
                                            f"between whitespace, not '{text.split()[-2 if text == '3 x 5' else 0]}'"):
            tok.tokenize(text)
    with pytest.raises(ConfigError, match="--tokenizer-type NullTokenizer needs --vocab-size N"):
        build_tokenizer("NullTokenizer")


def test_huggingface_tokenizer_json_file_and_folder(tmp_path, gpt2):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = gpt2_files()
    backend = Tokenizer(models.BPE.from_file(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    folder = tmp_path / "gpt2"
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    from_file = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(folder / "tokenizer.json"))
    assert from_file.tokenize("Hello world") == [15496, 995]
    assert from_file.eod == 50256  # found by its usual spelling
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "!"}))
    from_folder = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(folder))
    assert from_folder.pad == gpt2.tokenize("!")[0]  # declared in tokenizer_config.json
    assert from_folder.detokenize(from_folder.tokenize(TRICKY_TEXTS[3])) == TRICKY_TEXTS[3]


def test_bert_wordpiece_against_a_hand_written_vocabulary(tmp_path):
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s", ",", "!", "Hello"]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(tokens) + "\n")
    lower = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(vocab))
    cased = build_tokenizer("BertWordPieceCase", vocab_file=str(vocab))
    assert lower.tokenize("HELLO, Worlds!") == [5, 8, 6, 7, 9]
    assert cased.tokenize("Hello, worlds! HELLO") == [10, 8, 6, 7, 9, 1]
    assert (lower.pad, lower.cls, lower.sep, lower.mask, lower.eod) == (0, 2, 3, 4, 3)
    assert lower.detokenize([5, 8, 6, 7, 9]) == "hello, worlds!"
    assert lower.vocab_size == len(tokens)


def test_trained_tokenizers_load_through_build_tokenizer(tmp_path):
    bpe = build_tokenizer(**train_bpe(SAMPLE_CORPUS, 300, str(tmp_path / "bpe")))
    assert bpe.vocab_size <= 300 and bpe.eod == 0
    for text in SAMPLE_CORPUS + TRICKY_TEXTS:
        assert bpe.detokenize(bpe.tokenize(text)) == text
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "bpe-tokenizer.json"))
    assert hf.tokenize(SAMPLE_CORPUS[0]) == bpe.tokenize(SAMPLE_CORPUS[0])
    with pytest.raises(ConfigError, match="cannot train a 100-piece vocabulary"):
        train_sentencepiece(SAMPLE_CORPUS, 100, str(tmp_path / "sp"))  # byte fallback alone needs 256 pieces
    sp = build_tokenizer(**train_sentencepiece(SAMPLE_CORPUS, 400, str(tmp_path / "sp")))
    assert (sp.eod, sp.pad) == (2, 3)
    assert sp.detokenize(sp.tokenize("The lazy dog jumps.")) == "The lazy dog jumps."
    wp = build_tokenizer(**train_wordpiece(SAMPLE_CORPUS, 200, str(tmp_path / "wp")))
    assert wp.name == "BertWordPieceLowerCase" and {wp.pad, wp.cls, wp.sep, wp.mask} == {0, 2, 3, 4}
    assert wp.detokenize(wp.tokenize("The Quick brown fox")) == "the quick brown fox"


@pytest.mark.parametrize("tokenizer_type, given, missing", [
    ("GPT2BPETokenizer", {}, "--vocab-file"),
    ("GPT2BPETokenizer", {"vocab_file": "VOCAB"}, "--merge-file"),
    ("SentencePieceTokenizer", {}, "--tokenizer-model"),
    ("GPTSentencePieceTokenizer", {}, "--tokenizer-model"),
    ("Llama2Tokenizer", {}, "--tokenizer-model"),
    ("HuggingFaceTokenizer", {}, "--tokenizer-model"),
    ("BertWordPieceLowerCase", {}, "--vocab-file"),
    ("BertWordPieceCase", {}, "--vocab-file"),
])
def test_missing_tokenizer_file_names_the_flag(tmp_path, tokenizer_type, given, missing):
    existing = tmp_path / "file"
    existing.write_text("x")
    given = {name: str(existing) for name in given}
    with pytest.raises(ConfigError, match=f"--tokenizer-type {tokenizer_type} needs {missing} "):
        build_tokenizer(tokenizer_type, **given)


def test_bad_tokenizer_arguments_are_one_sentence_errors(tmp_path):
    with pytest.raises(ConfigError, match="--tokenizer-type Tiktoken is unknown; choose one of GPT2BPETokenizer"):
        build_tokenizer("Tiktoken")
    with pytest.raises(ConfigError, match="--vocab-file .*nope.txt does not exist"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match="is a directory without tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="is not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(junk))
    with pytest.raises(ConfigError, match="is not a valid tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(junk))
    assert set(TOKENIZER_TYPES) >= {"GPT2BPETokenizer", "ByteLevelTokenizer", "HuggingFaceTokenizer"}


def test_training_flags_build_megatrons_tokenizers_by_name():
    from megapipe.cli.parse import parse_config
    from megapipe.data.rank_data import run_tokenizer

    null = run_tokenizer("gpt", parse_config("gpt", ["--data-path", "x", "--tokenizer-type", "NullTokenizer",
                                                     "--vocab-size", "50"]))
    llama = run_tokenizer("gpt", parse_config("gpt", ["--data-path", "x", "--tokenizer-type", "Llama2Tokenizer",
                                                      "--tokenizer-model", mistral_sentencepiece_model()]))
    assert (null.name, null.vocab_size, llama.name, llama.tokenize("Hi")[0]) == ("NullTokenizer", 51,
                                                                                 "Llama2Tokenizer", 1)


def test_llama2_tokenizer_needs_a_bos_piece(tmp_path):
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(SAMPLE_CORPUS), model_prefix=str(tmp_path / "m"),
                                             vocab_size=60, bos_id=-1, hard_vocab_limit=False, minloglevel=2)
    model = str(tmp_path / "m.model")
    assert build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model).tokenize("fox")
    with pytest.raises(ConfigError, match=r"has no <s> \(bos\) piece, which Llama2Tokenizer starts every text "
                                          "with; use --tokenizer-type GPTSentencePieceTokenizer"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=model)
