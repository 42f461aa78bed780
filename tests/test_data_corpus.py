"""The built-in corpus: exact text, built once into the cache, usable by GPT and BERT; unigram entropy."""

import collections
import math
import os
import re

import numpy as np
import pytest

import megapipe.data.corpus as corpus
from data_helpers import write_dataset
from megapipe.data.builder import build_train_valid_test_datasets
from megapipe.data.index_cache import load_or_build
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.errors import DataError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("megapipe-cache"))


def test_gpt_corpus_holds_every_paragraph_exactly(cache):
    prefix, tokenizer = corpus.default_gpt_data(cache)
    ds = IndexedDataset(prefix, vocab_size=tokenizer.vocab_size)
    paragraphs = corpus.corpus_paragraphs()
    assert ds.num_documents == len(paragraphs) > 1000
    for d in (0, 1, len(paragraphs) // 2, len(paragraphs) - 1):
        ids = ds.document(d).tolist()
        assert ids[-1] == tokenizer.eod and tokenizer.detokenize(ids[:-1]) == paragraphs[d]
    assert len(ds.tokens) == sum(len(p.encode()) + 1 for p in paragraphs)
    assert prefix.startswith(cache)


def test_corpus_is_built_once(cache, monkeypatch):
    first = corpus.default_gpt_data(cache)[0]
    stamp = os.stat(first + ".bin").st_mtime_ns
    monkeypatch.setattr(corpus, "preprocess", lambda *a, **k: pytest.fail("rebuilt an existing corpus"))
    assert corpus.default_gpt_data(cache)[0] == first
    assert os.stat(first + ".bin").st_mtime_ns == stamp
    assert not [name for name in os.listdir(os.path.dirname(os.path.dirname(first))) if ".tmp" in name]


def test_cache_location_follows_megapipe_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAPIPE_CACHE", str(tmp_path / "env-cache"))
    prefix, _ = corpus.default_gpt_data()
    assert prefix.startswith(str(tmp_path / "env-cache")) and os.path.isfile(prefix + ".idx")


def test_bert_corpus_has_sentences_and_a_wordpiece_vocabulary(cache):
    prefix, tokenizer = corpus.default_bert_data(cache)
    assert tokenizer.name == "BertWordPieceLowerCase" and tokenizer.vocab_size == corpus.BERT_VOCAB_SIZE
    assert len({tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad}) == 4
    ds = IndexedDataset(prefix, vocab_size=tokenizer.vocab_size)
    assert ds.num_documents == len(corpus.corpus_topics()) and len(ds) > 3 * ds.num_documents
    words = re.findall(r"[^\W_]+", tokenizer.detokenize(ds.document(0)))
    assert words == re.findall(r"[^\W_]+", corpus.corpus_topics()[0].lower())  # WordPiece keeps words, not spacing
    train, valid, _ = build_train_valid_test_datasets("bert", [prefix], "969,30,1", 128, 1234, (64, 16, 0), tokenizer)
    item = train[0]
    assert item["text"][0] == tokenizer.cls and item["labels"].max() >= 0 and len(valid) == 16


def test_unigram_entropy_against_hand_counts(tmp_path, cache):
    prefix = write_dataset(str(tmp_path / "ds"), [[[0, 0, 1]], [[2]]])
    assert corpus.unigram_entropy(prefix) == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    gpt_prefix, _ = corpus.default_gpt_data(cache)
    counts = collections.Counter(b for p in corpus.corpus_paragraphs() for b in p.encode())
    counts[256] = len(corpus.corpus_paragraphs())  # one eod per paragraph
    total = sum(counts.values())
    expected = -sum(c / total * math.log(c / total) for c in counts.values())
    assert corpus.unigram_entropy(gpt_prefix) == pytest.approx(expected, rel=1e-9)


def test_unwritable_caches_are_reported(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(DataError, match="cannot write the default corpus cache in .*; set MEGAPIPE_CACHE"):
        corpus.default_gpt_data(str(blocker / "cache"))
    with pytest.raises(DataError, match="cannot write the dataset index cache in .*; pass --data-cache-path"):
        load_or_build(str(blocker / "cache"), {"kind": "x"}, lambda: {"a": np.zeros(1)})
