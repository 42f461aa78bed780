"""Blending: --data-path parsing, the error-minimising interleave, items routed to the right dataset."""

import numpy as np
import pytest

from data_helpers import write_dataset
from megapipe.data.blended_dataset import BlendedDataset, blending_index, build_blending_index, parse_data_path
from megapipe.data.builder import build_train_valid_test_datasets
from megapipe.data.tokenizer import build_tokenizer
from megapipe.errors import ConfigError, DataError

pytestmark = pytest.mark.unit

BYTE_LEVEL = build_tokenizer("ByteLevelTokenizer")


def test_data_path_forms():
    assert parse_data_path(["data/a"]) == [(1.0, "data/a")]
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_data_path(["1", "a", "3", "b"]) == [(0.25, "a"), (0.75, "b")]


@pytest.mark.parametrize("items, message", [
    ([], "is not valid"),
    (["a", "b"], "is not valid; give one dataset prefix or weight/prefix pairs"),
    (["0.5", "a", "b"], "is not valid"),
    (["0.5", "a", "x", "b"], "is not valid"),
    (["0", "a", "1", "b"], "has a weight that is not positive"),
])
def test_bad_data_paths(items, message):
    with pytest.raises(ConfigError, match=message):
        parse_data_path(items)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.25, 0.125, 0.125], [0.01, 0.99], [1 / 3] * 3])
def test_every_prefix_of_the_interleave_follows_the_weights(weights):
    index = build_blending_index(weights, 2000)
    chosen = index["dataset_index"]
    taken = np.zeros(len(weights))
    for i, d in enumerate(chosen):
        deficits = np.asarray(weights) * (i + 1) - taken
        assert d == int(np.argmax(deficits))  # the rule itself: furthest below its weight, lowest index on ties
        assert index["dataset_sample_index"][i] == taken[d]
        taken[d] += 1
        assert np.all(np.abs(taken - np.asarray(weights) * (i + 1)) < 1.0 + 1e-9)
    again = build_blending_index(weights, 2000)
    assert np.array_equal(again["dataset_index"], chosen)


def test_blended_items_come_from_their_dataset(tmp_path):
    low = write_dataset(str(tmp_path / "low"), [[[t] * 30] for t in range(0, 50)])
    high = write_dataset(str(tmp_path / "high"), [[[t] * 30] for t in range(100, 150)])
    train, valid, _ = build_train_valid_test_datasets("gpt", ["0.25", low, "0.75", high], "9,1,0", 8, 5,
                                                      (400, 40, 0), BYTE_LEVEL)
    assert isinstance(train, BlendedDataset) and len(train) == 400 and len(valid) == 40
    counts = np.bincount(train.dataset_index)
    assert counts.tolist() == [100, 300]
    for i in range(len(train)):
        tokens = train[i]["tokens"]
        assert (tokens < 100).all() if train.dataset_index[i] == 0 else (tokens >= 100).all()
    valid_tokens = set(np.concatenate([valid[i]["tokens"] for i in range(len(valid))]).tolist())
    assert valid_tokens <= set(range(45, 50)) | set(range(145, 150))  # the last tenth of each dataset


def test_blending_index_is_cached(tmp_path):
    first = blending_index([0.2, 0.8], 500, str(tmp_path))
    second = blending_index([0.2, 0.8], 500, str(tmp_path))
    assert len(list(tmp_path.iterdir())) == 1
    assert np.array_equal(first["dataset_index"], second["dataset_index"])


def test_unknown_prefix_names_itself_and_the_files_looked_for(tmp_path):
    known = write_dataset(str(tmp_path / "known"), [[[1, 2, 3]]])
    missing = str(tmp_path / "typo")
    with pytest.raises(DataError, match=f"--data-path prefix {missing} not found: looked for {missing}.bin and "
                                        f"{missing}.idx"):
        build_train_valid_test_datasets("gpt", ["0.5", known, "0.5", missing], "1", 4, 1, (4, 0, 0), BYTE_LEVEL)
