"""BERT samples: pair layout, sentence-order and next-sentence labels, 15% masking split 80/10/10."""

import numpy as np
import pytest

from data_helpers import write_dataset
from megapipe.data.bert_dataset import BERTDataset
from megapipe.data.builder import build_train_valid_test_datasets
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.tokenizer import build_tokenizer
from megapipe.data.tokenizer.training import train_bpe
from megapipe.errors import ConfigError, DataError

pytestmark = pytest.mark.unit

TOK = build_tokenizer("ByteLevelTokenizer")
SENTENCE_LENGTH = 3


def code(document, sentence):
    """Every token of sentence ``sentence`` of document ``document`` is this id (below 256, not special)."""
    return 10 + 40 * document + sentence


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
    rng = np.random.default_rng(0)
    documents = [[[code(d, k)] * SENTENCE_LENGTH for k in range(int(rng.integers(20, 40)))] for d in range(6)]
    return IndexedDataset(write_dataset(str(tmp_path_factory.mktemp("bert") / "ds"), documents))


def make(sentences, tmp_path, **options):
    options.setdefault("seq_length", 32)
    options.setdefault("num_samples", 600)
    options.setdefault("seed", 7)
    return BERTDataset(sentences, np.arange(sentences.num_documents), cache_dir=str(tmp_path), tokenizer=TOK,
                       **options)


def spans(item):
    """A and B as lists of (document, sentence) runs, from the unmasked text."""
    original = np.where(item["labels"] >= 0, item["labels"], item["text"])
    real = original[item["padding_mask"] == 1]
    types = item["types"][item["padding_mask"] == 1]
    first_sep = int(np.flatnonzero(types == 0)[-1])
    def runs(tokens):
        out = []
        for t in tokens.tolist():
            key = divmod(t - 10, 40)
            if not out or out[-1] != key:
                out.append(key)
        return out
    return runs(real[1:first_sep]), runs(real[first_sep + 1:-1])


def consecutive(run):
    return all(d == run[0][0] for d, _ in run) and [k for _, k in run] == list(range(run[0][1], run[0][1] + len(run)))


def test_layout_types_padding_and_masks(sentences, tmp_path):
    ds = make(sentences, tmp_path)
    for i in range(200):
        item = ds[i]
        real = int(item["padding_mask"].sum())
        text, types = item["text"], item["types"]
        first_sep = int(np.flatnonzero(types[:real] == 0)[-1])
        assert text[0] == TOK.cls and text[first_sep] == TOK.sep and text[real - 1] == TOK.sep
        assert types[:first_sep + 1].tolist() == [0] * (first_sep + 1)
        assert types[first_sep + 1:real].tolist() == [1] * (real - first_sep - 1) and real - first_sep - 1 >= 2
        assert (text[real:] == TOK.pad).all() and (types[real:] == 0).all() and (item["labels"][real:] == -1).all()
        assert item["padding_mask"].tolist() == [1] * real + [0] * (32 - real)
        assert item["loss_mask"].tolist() == (item["labels"] >= 0).astype(np.float32).tolist()
        assert {k: v.dtype for k, v in item.items()} == {
            "text": np.int64, "types": np.int64, "labels": np.int64, "is_random": np.int64,
            "loss_mask": np.float32, "padding_mask": np.int64}


def test_sentence_order_pairs_are_consecutive_and_swapped_when_random(sentences, tmp_path):
    ds = make(sentences, tmp_path, pair_task="sop", short_seq_prob=0.0)
    randoms = []
    for i in range(len(ds)):
        item = ds[i]
        a, b = spans(item)
        assert consecutive(a) and consecutive(b)
        first, second = (b, a) if item["is_random"] else (a, b)
        assert consecutive(first + second)  # B continues A, or A continues B when swapped
        randoms.append(int(item["is_random"]))
    assert abs(np.mean(randoms) - 0.5) < 0.07


def test_next_sentence_pairs_take_random_b_from_another_document(sentences, tmp_path):
    ds = make(sentences, tmp_path, pair_task="nsp", short_seq_prob=0.0)
    randoms = []
    for i in range(len(ds)):
        item = ds[i]
        a, b = spans(item)
        assert consecutive(a) and consecutive(b)
        if item["is_random"]:
            assert a[0][0] != b[0][0]
        else:
            assert consecutive(a + b)
        randoms.append(int(item["is_random"]))
    assert abs(np.mean(randoms) - 0.5) < 0.07


def test_fifteen_percent_masked_as_80_10_10(sentences, tmp_path):
    ds = make(sentences, tmp_path, seq_length=128, num_samples=1500)
    predicted = candidates = masked = kept = replaced = 0
    for i in range(len(ds)):
        item = ds[i]
        real = item["padding_mask"] == 1
        special = np.isin(item["text"], [TOK.cls, TOK.sep]) & (item["labels"] < 0)
        chosen = item["labels"] >= 0
        n = int((real & ~special).sum())
        assert not (chosen & (special | ~real)).any()
        assert abs(chosen.sum() - 0.15 * n) <= 0.5 or chosen.sum() == 1
        predicted, candidates = predicted + chosen.sum(), candidates + n
        text, labels = item["text"][chosen], item["labels"][chosen]
        masked += (text == TOK.mask).sum()
        kept += (text == labels).sum()
        others = text[(text != TOK.mask) & (text != labels)]
        replaced += len(others)
        assert (others < 256).all()  # random replacements are never special tokens
    assert abs(predicted / candidates - 0.15) < 0.005
    assert abs(masked / predicted - 0.8) < 0.01
    assert abs(kept / predicted - 0.1) < 0.01 and abs(replaced / predicted - 0.1) < 0.01


def test_items_depend_only_on_seed_and_index(sentences, tmp_path):
    first, second = make(sentences, tmp_path / "a"), make(sentences, tmp_path / "b")
    other_seed = make(sentences, tmp_path / "c", seed=8)
    for i in (0, 5, 599, 5):
        assert all(np.array_equal(first[i][k], second[i][k]) for k in first[i])
    assert any(not np.array_equal(first[i]["text"], other_seed[i]["text"]) for i in range(20))


def test_without_binary_head_there_is_one_segment(sentences, tmp_path):
    ds = make(sentences, tmp_path, binary_head=False)
    for i in range(50):
        item = ds[i]
        real = int(item["padding_mask"].sum())
        assert (item["types"] == 0).all() and item["is_random"] == 0
        assert item["text"][0] == TOK.cls and item["text"][real - 1] == TOK.sep
        assert (item["text"][1:real - 1] != TOK.sep).all()


def test_builder_makes_bert_splits(sentences):
    train, valid, test = build_train_valid_test_datasets("bert", [sentences.prefix], "4,2,0", 32, 1, (50, 10, 0), TOK,
                                                         pair_task="nsp")
    assert len(train) == 50 and len(valid) == 10 and test is None
    assert {spans(train[i])[0][0][0] for i in range(50)} <= {0, 1, 2, 3}


def test_bad_bert_inputs(sentences, tmp_path):
    documents_only = write_dataset(str(tmp_path / "docs"), [[[5, 6, 7, 8]]] * 4)
    with pytest.raises(DataError, match="no document has 2 or more sentences.*--split-sentences"):
        build_train_valid_test_datasets("bert", [documents_only], "1", 32, 1, (10, 0, 0), TOK)
    bpe = build_tokenizer(**train_bpe(["some text to learn from"] * 5, 300, str(tmp_path / "bpe")))
    with pytest.raises(ConfigError, match=r"GPT2BPETokenizer lacks a \[CLS\] token, which BERT needs; use"):
        BERTDataset(sentences, np.arange(2), 10, 32, 1, str(tmp_path), bpe)
    with pytest.raises(DataError, match="has 1 non-empty document.* next-sentence prediction needs at least 2"):
        BERTDataset(sentences, np.arange(1), 10, 32, 1, str(tmp_path), TOK, pair_task="nsp")
    with pytest.raises(ConfigError, match="BERT pair task mlm is unknown"):
        make(sentences, tmp_path, pair_task="mlm")
    with pytest.raises(ConfigError, match="--seq-length 4 is too short for BERT"):
        make(sentences, tmp_path, seq_length=4)


def test_order_is_prefix_stable_so_longer_runs_extend_shorter_ones(sentences, tmp_path):
    """A run asking for more samples (a larger --train-iters) serves the shorter run's samples first."""
    short = BERTDataset(sentences, np.arange(sentences.num_documents), 20, 32, 7, str(tmp_path), TOK)
    long = BERTDataset(sentences, np.arange(sentences.num_documents), 300, 32, 7, str(tmp_path), TOK)
    assert len(short) == 20 and len(long) == 300
    for i in range(20):
        for key, value in short[i].items():
            assert np.array_equal(value, long[i][key]), (i, key)
