"""Train small tokenizers on local text and write the files ``build_tokenizer`` loads.

Each function returns the ``build_tokenizer`` keyword arguments that load what it wrote.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

import sentencepiece
from tokenizers.implementations import BertWordPieceTokenizer, ByteLevelBPETokenizer

from megapipe.errors import ConfigError

BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _split_prefix(output_prefix: str) -> tuple[str, str]:
    directory, name = os.path.split(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)
    return directory, name


def train_bpe(texts: Iterable[str], vocab_size: int, output_prefix: str) -> dict[str, str]:
    """GPT-2 style byte-level BPE with ``<|endoftext|>``.

    Writes ``<prefix>-vocab.json`` + ``<prefix>-merges.txt`` (GPT2BPETokenizer) and
    ``<prefix>-tokenizer.json`` (HuggingFaceTokenizer); returns the GPT2BPETokenizer arguments.
    """
    directory, name = _split_prefix(output_prefix)
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                                show_progress=False)
    vocab_file, merge_file = trainer.save_model(directory, name)
    trainer.save(os.path.join(directory, f"{name}-tokenizer.json"))
    return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab_file, "merge_file": merge_file}


def _lines(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        yield from (line for line in text.splitlines() if line.strip())


def train_sentencepiece(texts: Iterable[str], vocab_size: int, output_prefix: str,
                        model_type: str = "unigram") -> dict[str, str]:
    """A SentencePiece model (``<prefix>.model``) with <unk>=0, <s>=1, </s>=2 (eod) and <pad>=3.

    SentencePiece learns from lines, so each text is fed line by line; byte fallback keeps
    characters outside the vocabulary encodable.
    """
    directory, name = _split_prefix(output_prefix)
    model_prefix = os.path.join(directory, name)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=_lines(texts), model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
            pad_id=3, byte_fallback=True, hard_vocab_limit=False, minloglevel=2)
    except RuntimeError as error:
        reason = str(error).split("] ")[-1].split(".")[0]  # the library's own words, without its file/line prefix
        raise ConfigError(f"SentencePiece cannot train a {vocab_size}-piece vocabulary here ({reason}); "
                          "change --vocab-size.") from None
    return {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": model_prefix + ".model"}


def train_wordpiece(texts: Iterable[str], vocab_size: int, output_prefix: str,
                    lowercase: bool = True) -> dict[str, str]:
    """A BERT WordPiece vocabulary (``<prefix>-vocab.txt``) with [PAD] [UNK] [CLS] [SEP] [MASK]."""
    directory, name = _split_prefix(output_prefix)
    trainer = BertWordPieceTokenizer(lowercase=lowercase)
    trainer.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=BERT_SPECIAL_TOKENS,
                                show_progress=False)
    (vocab_file,) = trainer.save_model(directory, name)
    tokenizer_type = "BertWordPieceLowerCase" if lowercase else "BertWordPieceCase"
    return {"tokenizer_type": tokenizer_type, "vocab_file": vocab_file}
