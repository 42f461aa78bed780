"""Every tokenizer type travels inside a checkpoint and out to Hugging Face unchanged.

Each type (the byte-level default, OpenAI's GPT-2 BPE files, BERT WordPiece lower- and
cased, Mistral's SentencePiece model under Megatron's three SentencePiece names, a tokenizer.json,
the null tokenizer) is saved the way a checkpoint save
stores it and rebuilt from the checkpoint alone: same type, vocabulary, special ids, ids and
text. Its Hugging Face export loads in ``AutoTokenizer`` and encodes every text to megapipe's
ids, with eos/pad at megapipe's special tokens.
"""

import os

import pytest
import transformers

from data_helpers import gpt2_files, mistral_sentencepiece_model
from megapipe.checkpointing.hf_tokenizer import save_hf_tokenizer
from megapipe.checkpointing.tokenizer_files import TOKENIZER_DIR, read_tokenizer, write_tokenizer
from megapipe.data.tokenizer import build_tokenizer
from megapipe.data.tokenizer.base import SPECIAL_ROLES
from megapipe.data.tokenizer.build import FILE_ARGUMENTS
from megapipe.data.tokenizer.null import NullTokenizer
from megapipe.data.tokenizer.training import train_bpe, train_wordpiece

pytestmark = pytest.mark.unit

TEXTS = ["The capital of France is", "  leading spaces, trailing tab\t", "line one\n\nline three",
         "Unicode: héllo wörld, Ελληνικά, 日本語 🎉"]
TYPES = ["ByteLevelTokenizer", "GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
         "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer"]
EXPORTED_TYPES = TYPES + ["NullTokenizer"]
STORED_TYPES = EXPORTED_TYPES + ["Llama2Tokenizer"]  # its leading bos is not what transformers adds


def texts_for(name):
    """NullTokenizer's texts are numbers."""
    return ["1 2 3", "  0\t99\n42 "] if name == "NullTokenizer" else TEXTS
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 20, "Pack my box with five dozen liquor jugs! " * 20]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Type name -> a tokenizer built from files outside any checkpoint."""
    trained = tmp_path_factory.mktemp("trained")
    vocab, merges = gpt2_files()
    bpe = train_bpe(CORPUS, 300, str(trained / "bpe"))
    built = {"ByteLevelTokenizer": build_tokenizer("ByteLevelTokenizer"),
             "GPT2BPETokenizer": build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
             "NullTokenizer": build_tokenizer("NullTokenizer", vocab_size=100),
             "HuggingFaceTokenizer": build_tokenizer("HuggingFaceTokenizer",
                                                     tokenizer_model=bpe["vocab_file"].replace("-vocab.json",
                                                                                               "-tokenizer.json"))}
    for name in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        built[name] = build_tokenizer(name, tokenizer_model=mistral_sentencepiece_model())
    for lowercase in (True, False):
        args = train_wordpiece(CORPUS, 200, str(trained / f"wordpiece-{lowercase}"), lowercase=lowercase)
        built[args["tokenizer_type"]] = build_tokenizer(**args)
    return built


@pytest.mark.parametrize("name", STORED_TYPES)
def test_a_checkpoint_rebuilds_its_tokenizer(tokenizers, name, tmp_path):
    original = tokenizers[name]
    spec = write_tokenizer(original, str(tmp_path))
    files = [value for flag, value in spec.items() if flag in FILE_ARGUMENTS]
    assert all(os.path.isfile(tmp_path / TOKENIZER_DIR / f) for f in files)  # inside the checkpoint only
    back = read_tokenizer(str(tmp_path), spec)
    assert (back.name, back.vocab_size) == (original.name, original.vocab_size)
    assert {role: back.special_id(role) for role in SPECIAL_ROLES} == {
        role: original.special_id(role) for role in SPECIAL_ROLES}
    for text in texts_for(name):
        ids = original.tokenize(text)
        assert back.tokenize(text) == ids
        assert back.detokenize(ids) == original.detokenize(ids)


@pytest.mark.parametrize("name", EXPORTED_TYPES)
def test_the_hugging_face_export_encodes_like_megapipe(tokenizers, name, tmp_path):
    ours = tokenizers[name]
    save_hf_tokenizer(ours, str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in texts_for(name):
        ids = ours.tokenize(text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids, text
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (
        ours.special_id("eod"), ours.special_id("eod"), ours.special_id("pad"))
    assert theirs.eos_token_id is not None and theirs.eos_token_id < ours.vocab_size


def test_tokenizers_without_files_are_stored_by_type_alone(tmp_path):
    assert write_tokenizer(NullTokenizer(100), str(tmp_path)) == {"tokenizer_type": "NullTokenizer", "vocab_size": 100}
    assert write_tokenizer(build_tokenizer("ByteLevelTokenizer"), str(tmp_path)) == {
        "tokenizer_type": "ByteLevelTokenizer"}
    assert os.listdir(tmp_path) == []
    assert write_tokenizer(None, str(tmp_path)) is None and read_tokenizer(str(tmp_path), None) is None
