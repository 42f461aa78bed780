"""GPT samples against an independent slice of the shuffled document stream; splits; the index cache."""

import multiprocessing
import os
import re

import numpy as np
import pytest

import megapipe.data.gpt_dataset as gpt_dataset
from data_helpers import build_index_in_process, random_documents, write_dataset
from megapipe.data.builder import build_train_valid_test_datasets
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.index_cache import load_or_build
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.packing import Packing
from megapipe.data.splits import parse_split, split_document_ranges
from megapipe.data.tokenizer import build_tokenizer
from megapipe.errors import ConfigError, DataError

BYTE_LEVEL = build_tokenizer("ByteLevelTokenizer")


@pytest.fixture
def indexed(tmp_path):
    documents = random_documents(np.random.default_rng(1), count=40, max_sequences=1, max_length=30, vocab=250)
    documents[5] = documents[17] = []  # empty documents must be skipped over
    return IndexedDataset(write_dataset(str(tmp_path / "ds"), documents))


def expected_windows(indexed, documents, num_samples, seq_length, seed):
    """The specification, reimplemented: epoch e's documents in the order default_rng([seed, e])
    permutes them; the windows that start in epoch e served in the order default_rng([seed, e, 1])
    permutes them; epochs until num_samples windows have started."""
    total = sum(len(indexed.document(d)) for d in documents)
    stream, served, epoch = [], [], 0
    while len(served) < num_samples:
        first, end = -(-epoch * total // seq_length), -(-(epoch + 1) * total // seq_length)
        served += [first + k for k in np.random.default_rng([seed, epoch, 1]).permutation(end - first)]
        epoch += 1
    while len(stream) < (max(served) + 1) * seq_length + 1:
        for k in np.random.default_rng([seed, len(stream) // total]).permutation(len(documents)):
            stream.extend(indexed.document(documents[k]).tolist())
    return [stream[j * seq_length:(j + 1) * seq_length + 1] for j in served[:num_samples]]


@pytest.mark.unit
@pytest.mark.parametrize("num_samples, seq_length", [(7, 16), (120, 24), (1, 1)])
def test_samples_are_slices_of_the_shuffled_document_stream(indexed, tmp_path, num_samples, seq_length):
    documents = np.arange(3, 35)
    ds = GPTDataset(indexed, documents, num_samples, seq_length, seed=11, cache_dir=str(tmp_path / "cache"))
    assert len(ds) == num_samples
    for item, window in zip((ds[i] for i in range(len(ds))), expected_windows(indexed, documents, num_samples,
                                                                               seq_length, 11)):
        assert item["tokens"].tolist() == window[:-1]
        assert item["labels"].tolist() == window[1:]
        assert item["tokens"].dtype == item["labels"].dtype == np.int64
        assert item["loss_mask"].dtype == np.float32 and item["loss_mask"].tolist() == [1.0] * seq_length


@pytest.mark.unit
def test_order_is_prefix_stable_so_longer_runs_extend_shorter_ones(indexed, tmp_path):
    """A run asking for more samples (a larger --train-iters) serves the shorter run's samples first,
    across epoch boundaries, with its own cached index."""
    cache = str(tmp_path / "cache")
    short = GPTDataset(indexed, np.arange(40), 30, 16, seed=5, cache_dir=cache)
    long = GPTDataset(indexed, np.arange(40), 400, 16, seed=5, cache_dir=cache)
    assert len(short) == 30 and len(long) == 400 and len(os.listdir(cache)) == 2
    for i in range(30):
        assert np.array_equal(short[i]["tokens"], long[i]["tokens"])


@pytest.mark.unit
def test_packing_masks_the_loss_and_resets_positions_and_documents_after_eod(tmp_path):
    """Windows cross documents: positions restart and the document id grows after every eod input."""
    prefix = write_dataset(str(tmp_path / "ds"), [[[1, 2, BYTE_LEVEL.eod]], [[3, BYTE_LEVEL.eod]]] * 10)
    packing = Packing(BYTE_LEVEL.eod, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    ds = GPTDataset(IndexedDataset(prefix), np.arange(20), 10, 8, seed=0, cache_dir=str(tmp_path / "c"),
                    packing=packing)
    for i in range(len(ds)):
        item = ds[i]
        ends = [t == BYTE_LEVEL.eod for t in item["tokens"]]
        assert item["loss_mask"].tolist() == [0.0 if end else 1.0 for end in ends]
        assert item["document_ids"].tolist() == [sum(ends[:j]) for j in range(8)]
        starts = [0] + [j + 1 for j in range(7) if ends[j]]
        assert item["position_ids"].tolist() == [j - max(s for s in starts if s <= j) for j in range(8)]


@pytest.mark.unit
def test_index_is_built_once_and_reused(indexed, tmp_path, monkeypatch):
    builds = []
    original = gpt_dataset.build_sample_index
    monkeypatch.setattr(gpt_dataset, "build_sample_index", lambda *a: builds.append(a) or original(*a))
    cache = str(tmp_path / "cache")
    first = GPTDataset(indexed, np.arange(40), 50, 16, seed=3, cache_dir=cache)
    again = GPTDataset(indexed, np.arange(40), 50, 16, seed=3, cache_dir=cache)
    assert len(builds) == 1
    assert np.array_equal(first.sample_order, again.sample_order)
    GPTDataset(indexed, np.arange(40), 50, 16, seed=4, cache_dir=cache)  # another seed is another index
    assert len(builds) == 2
    folders = os.listdir(cache)
    assert len(folders) == 2 and all(f.startswith("gpt-") and ".tmp" not in f for f in folders)
    assert sorted(os.listdir(os.path.join(cache, folders[0]))) == [
        "description.json", "document_order.npy", "sample_order.npy", "sample_start.npy"]


@pytest.mark.unit
def test_failed_build_leaves_no_index_behind(tmp_path):
    def crash():
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        load_or_build(str(tmp_path), {"kind": "test"}, crash)
    assert os.listdir(tmp_path) == []
    arrays = load_or_build(str(tmp_path), {"kind": "test"}, lambda: {"a": np.arange(3)})
    assert arrays["a"].tolist() == [0, 1, 2]


@pytest.mark.unit
def test_a_rank_that_loses_the_publishing_race_uses_the_winners_index(tmp_path):
    description = {"kind": "race"}

    def build_while_another_rank_publishes():
        load_or_build(str(tmp_path), description, lambda: {"a": np.arange(4)})  # the other rank wins
        return {"a": np.arange(4)}

    arrays = load_or_build(str(tmp_path), description, build_while_another_rank_publishes)
    assert arrays["a"].tolist() == [0, 1, 2, 3]
    assert len(os.listdir(tmp_path)) == 1


@pytest.mark.distributed
def test_processes_building_the_same_index_at_once_agree(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    processes = [ctx.Process(target=build_index_in_process, args=(str(tmp_path), start, results)) for _ in range(3)]
    for process in processes:
        process.start()
    start.set()
    sums = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    assert sums == [int((np.arange(200_000) * 7).sum())] * 3
    assert len(os.listdir(tmp_path)) == 1  # one published folder, no temporary leftovers


@pytest.mark.unit
def test_split_string_parsing_and_document_ranges():
    assert parse_split("969,30,1") == [969.0, 30.0, 1.0]
    assert parse_split("98/2") == [98.0, 2.0, 0.0]
    assert split_document_ranges(1000, [969, 30, 1]) == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(10, [1, 1, 1]) == [(0, 3), (3, 7), (7, 10)]
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(ConfigError, match=f"--split {bad} is not valid"):
            parse_split(bad)


@pytest.mark.unit
def test_train_valid_test_use_disjoint_documents_in_proportion(tmp_path):
    documents = [[[d] * 20] for d in range(200)]  # document d is made only of token d
    prefix = write_dataset(str(tmp_path / "ds"), documents)
    tokenizer = build_tokenizer("ByteLevelTokenizer")
    train, valid, test = build_train_valid_test_datasets("gpt", [prefix], "90,8,2", 10, 1, (500, 60, 20), tokenizer)
    seen = [set(np.concatenate([ds[i]["tokens"] for i in range(len(ds))]).tolist()) for ds in (train, valid, test)]
    assert seen[0] <= set(range(180)) and seen[1] <= set(range(180, 196)) and seen[2] <= set(range(196, 200))
    assert len(seen[1]) == 16 and len(seen[2]) == 4  # 60 and 20 samples cover every document of their split
    assert [len(train), len(valid), len(test)] == [500, 60, 20]
    assert os.path.isdir(tmp_path / "index-cache")  # default cache next to the data
    none_split = build_train_valid_test_datasets("gpt", [prefix], "1,0,0", 10, 1, (5, 5, 0), tokenizer)
    assert none_split[1] is None and none_split[2] is None


@pytest.mark.unit
def test_split_without_tokens_is_reported(tmp_path):
    prefix = write_dataset(str(tmp_path / "ds"), [[[1, 2, 3]]] * 3 + [[]])  # the valid split's document is empty
    with pytest.raises(DataError, match="the valid split of .* has no tokens but 4 samples were asked for"):
        build_train_valid_test_datasets("gpt", [prefix], "3,1,0", 4, 1, (4, 4, 0), BYTE_LEVEL)
    with pytest.raises(ConfigError, match="dataset kind t5 is unknown"):
        build_train_valid_test_datasets("t5", [prefix], "1", 4, 1, (4, 0, 0), BYTE_LEVEL)


@pytest.mark.unit
@pytest.mark.parametrize("count, samples", [(20, (4, 4, 4)), (150, (4, 4, 4)), (2, (4, 4, 4)), (10, (4, 4, 0))])
def test_a_split_that_gets_no_document_names_one_that_works(tmp_path, count, samples):
    """Megatron's default 969,30,1 leaves the test split of a small corpus empty: the error names a split
    that gives every split that samples are asked of a document (as many as there are), and that split runs."""
    prefix = write_dataset(str(tmp_path / "ds"), [[[d % 250 + 1] * 8] for d in range(count)])
    with pytest.raises(DataError, match=f"--split 969,30,1 gives the .* split of {prefix} none of its {count} "
                                        "documents; use --split") as refused:
        build_train_valid_test_datasets("gpt", [prefix], "969,30,1", 4, 1, samples, BYTE_LEVEL)
    suggested = re.search(r"use --split (\S+) \(documents per split\)", str(refused.value))[1]
    datasets = build_train_valid_test_datasets("gpt", [prefix], suggested, 4, 1, samples, BYTE_LEVEL)
    built = [n > 0 and w > 0 for n, w in zip(samples, parse_split(suggested))]
    assert [ds is not None for ds in datasets] == built
    assert built == ([True, True, False] if count == 2 else [n > 0 for n in samples])
