"""``build_tokenizer``: Megatron's --tokenizer-type names mapped to tokenizer classes, with flag checks."""

from __future__ import annotations

import os
from typing import Optional

from megapipe.data.tokenizer.base import Tokenizer
from megapipe.errors import ConfigError

# tokenizer type -> the flags it needs, each with a description of the file it names.
REQUIRED_FLAGS = {
    "GPT2BPETokenizer": {"vocab_file": "the GPT-2 vocab.json / encoder.json",
                         "merge_file": "the GPT-2 merges.txt / vocab.bpe"},
    "SentencePieceTokenizer": {"tokenizer_model": "the SentencePiece .model file"},
    "GPTSentencePieceTokenizer": {"tokenizer_model": "the SentencePiece .model file"},
    "Llama2Tokenizer": {"tokenizer_model": "Llama 2's tokenizer.model (SentencePiece)"},
    "HuggingFaceTokenizer": {"tokenizer_model": "a tokenizer.json or a folder holding one"},
    "BertWordPieceLowerCase": {"vocab_file": "the BERT vocab.txt"},
    "BertWordPieceCase": {"vocab_file": "the BERT vocab.txt"},
    "ByteLevelTokenizer": {},
    "NullTokenizer": {},  # --vocab-size instead of a file
}
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
FILE_ARGUMENTS = ("vocab_file", "merge_file", "tokenizer_model")
TOKENIZER_TYPES = tuple(REQUIRED_FLAGS)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _readers(name: str) -> str:
    """The tokenizer types that read the file flag ``name``, as a phrase."""
    return " or ".join(t for t, needs in REQUIRED_FLAGS.items() if name in needs)


def check_tokenizer_files(tokenizer_type: Optional[str], paths: dict[str, Optional[str]]) -> None:
    """Refuse a file flag that ``tokenizer_type`` does not read (or that comes without a type), and a
    needed file that is missing: no tokenizer flag is ever ignored."""
    for name in FILE_ARGUMENTS:
        if paths.get(name) is not None and (tokenizer_type is None or name not in REQUIRED_FLAGS[tokenizer_type]):
            used = "no --tokenizer-type is given" if tokenizer_type is None else \
                f"--tokenizer-type {tokenizer_type} does not read it"
            raise ConfigError(f"{_flag(name)} is read by --tokenizer-type {_readers(name)} only and {used}; "
                              f"name the tokenizer it belongs to or drop {_flag(name)}.")
    for name, what in REQUIRED_FLAGS.get(tokenizer_type, {}).items():
        path = paths[name]
        if path is None:
            raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {_flag(name)} ({what}); pass its path.")
        if not os.path.exists(path):
            hub = " (megapipe reads local files only: save the tokenizer from the Hub into a folder first)" \
                if tokenizer_type == "HuggingFaceTokenizer" and not os.path.isabs(path) else ""
            raise ConfigError(f"{_flag(name)} {path} does not exist; pass the path of {what}{hub}.")


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None) -> Tokenizer:
    """Build the tokenizer Megatron's ``--tokenizer-type`` names from the files the other flags give
    (``vocab_size``: NullTokenizer's ``--vocab-size``).

    Raises ConfigError naming the flag when a needed file is missing, a file is given that the type
    does not read, or the type is unknown.
    """
    if tokenizer_type not in REQUIRED_FLAGS:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} is unknown; choose one of {', '.join(TOKENIZER_TYPES)}.")
    check_tokenizer_files(tokenizer_type, {"vocab_file": vocab_file, "merge_file": merge_file,
                                           "tokenizer_model": tokenizer_model})
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ConfigError(f"--tokenizer-type NullTokenizer needs --vocab-size N (at least 1, got {vocab_size}): "
                              "the text holds ids 0 to N-1 and id N ends each document.")
        from megapipe.data.tokenizer.null import NullTokenizer
        return NullTokenizer(vocab_size)
    if tokenizer_type == "ByteLevelTokenizer":
        from megapipe.data.tokenizer.byte_level import ByteLevelTokenizer
        return ByteLevelTokenizer()
    if tokenizer_type in SENTENCEPIECE_TYPES:
        from megapipe.data.tokenizer import sentencepiece_model
        return getattr(sentencepiece_model, tokenizer_type)(tokenizer_model)
    from megapipe.data.tokenizer import hf_backed
    if tokenizer_type == "GPT2BPETokenizer":
        return hf_backed.gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return hf_backed.huggingface(tokenizer_model)
    return hf_backed.bert_wordpiece(vocab_file, lowercase=tokenizer_type == "BertWordPieceLowerCase")
