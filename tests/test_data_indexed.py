"""Indexed .bin/.idx datasets: the documented byte layout, zero-copy reads, atomic writes, every error."""

import os
import struct

import numpy as np
import pytest

from data_helpers import random_documents, write_dataset
from megapipe.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, dtype_for_vocab
from megapipe.errors import DataError

pytestmark = pytest.mark.unit


@pytest.fixture
def documents():
    return random_documents(np.random.default_rng(0), count=30, max_sequences=4, max_length=20, vocab=1000) + [[]]


# format -> (header struct, length dtype, boundaries beyond the header's count)
BY_HAND = {"megatron": ("<9sQBQQ", "<i4", 0), "megapipe": ("<8sIIQQ", "<i8", 1)}


def parse_idx_by_hand(path, output_format):
    """Read an .idx following the layout written in the module docstring, independently of the reader."""
    header, length_dtype, extra = BY_HAND[output_format]
    data = open(path, "rb").read()
    magic, version, dtype_code, n, count = struct.unpack_from(header, data, 0)
    offset = struct.calcsize(header)
    lengths = np.frombuffer(data, dtype=length_dtype, count=n, offset=offset)
    pointers = np.frombuffer(data, dtype="<i8", count=n, offset=offset + lengths.nbytes)
    boundaries = np.frombuffer(data, dtype="<i8", offset=offset + lengths.nbytes + pointers.nbytes)
    assert len(boundaries) == count + extra
    return magic, version, dtype_code, lengths, pointers, boundaries, len(data)


@pytest.mark.parametrize("output_format, dtype, magic, code, header_size, length_size", [
    ("megatron", np.uint16, b"MMIDIDX\x00\x00", 8, 34, 4), ("megatron", np.int32, b"MMIDIDX\x00\x00", 4, 34, 4),
    ("megatron", np.uint8, b"MMIDIDX\x00\x00", 1, 34, 4), ("megatron", np.int64, b"MMIDIDX\x00\x00", 5, 34, 4),
    ("megapipe", np.uint16, b"MPIPEIDX", 1, 32, 8), ("megapipe", np.int32, b"MPIPEIDX", 2, 32, 8)])
def test_layout_matches_the_documented_format(tmp_path, documents, output_format, dtype, magic, code,
                                              header_size, length_size):
    documents = [[[t % 250 for t in s] for s in doc] for doc in documents]
    prefix = write_dataset(str(tmp_path / "ds"), documents, dtype, output_format)
    found_magic, version, dtype_code, lengths, pointers, boundaries, size = parse_idx_by_hand(prefix + ".idx",
                                                                                              output_format)
    sequences = [s for doc in documents for s in doc]
    assert (found_magic, version, dtype_code) == (magic, 1, code)
    assert size == header_size + (length_size + 8) * len(sequences) + 8 * (len(documents) + 1)
    assert lengths.tolist() == [len(s) for s in sequences]
    assert boundaries.tolist() == np.cumsum([0] + [len(doc) for doc in documents]).tolist()
    raw = np.fromfile(prefix + ".bin", dtype=np.dtype(dtype).newbyteorder("<"))
    assert raw.nbytes == os.path.getsize(prefix + ".bin")
    for sequence, pointer in zip(sequences, pointers):
        start = pointer // np.dtype(dtype).itemsize
        assert raw[start:start + len(sequence)].tolist() == sequence
    ds = IndexedDataset(prefix)
    assert ds.format == output_format and ds.dtype == np.dtype(dtype)
    assert [ds.document(d).tolist() for d in range(ds.num_documents)] == [sum(doc, []) for doc in documents]


def test_reader_returns_every_sequence_and_document_without_copies(tmp_path, documents):
    ds = IndexedDataset(write_dataset(str(tmp_path / "ds"), documents), vocab_size=1000)
    sequences = [s for doc in documents for s in doc]
    assert len(ds) == len(sequences) and ds.num_documents == len(documents)
    for i, sequence in enumerate(sequences):
        assert ds[i].tolist() == sequence
        assert np.shares_memory(ds[i], ds.tokens)
    for d, doc in enumerate(documents):
        assert ds.document(d).tolist() == [t for s in doc for t in s]
        assert ds.document_lengths[d] == sum(map(len, doc))
    assert ds.get(1, offset=2, length=3).tolist() == sequences[1][2:5]
    assert ds.dtype == np.uint16 and ds.max_token_id == max(t for s in sequences for t in s)


def test_dtype_follows_vocabulary_size():
    assert dtype_for_vocab(50257) == np.uint16 and dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.int32


def test_builder_publishes_nothing_until_finalized_and_cleans_up_on_error(tmp_path):
    prefix = str(tmp_path / "ds")
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    builder.add_document([[1, 2, 3]])
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    builder.finalize()
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "broken"), np.uint16) as broken:
            broken.add_document([[1]])
            raise RuntimeError("crash while writing")
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]
    with pytest.raises(DataError, match="token id 70000 does not fit the dataset dtype uint16"):
        with IndexedDatasetBuilder(str(tmp_path / "big"), np.uint16) as big:
            big.add_document([[1, 70000]])
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]


@pytest.fixture(params=["megatron", "megapipe"])
def dataset_prefix(tmp_path, documents, request):
    return write_dataset(str(tmp_path / "ds"), documents, np.uint16, request.param)


def corrupt(path, transform):
    data = open(path, "rb").read()
    open(path, "wb").write(transform(data))


def test_missing_files_name_the_prefix_and_both_files(dataset_prefix):
    os.remove(dataset_prefix + ".idx")
    with pytest.raises(DataError, match=f"prefix {dataset_prefix} not found: looked for {dataset_prefix}.bin and "
                                        f"{dataset_prefix}.idx, missing {dataset_prefix}.idx;"):
        IndexedDataset(dataset_prefix)
    with pytest.raises(DataError, match=r"give the prefix without \.bin/\.idx"):
        IndexedDataset(dataset_prefix + ".bin")


def test_missing_bin_file(dataset_prefix):
    os.remove(dataset_prefix + ".bin")
    with pytest.raises(DataError, match=f"missing {dataset_prefix}.bin;"):
        IndexedDataset(dataset_prefix)


@pytest.mark.parametrize("transform, message", [
    (lambda data: data[:-8], "is truncated or corrupt"),
    (lambda data: data[:20], r"is truncated .20 bytes, shorter than its 3\d-byte \w+ header"),
    (lambda data: b"MMIDIDX\x01" + data[8:], r"is not a Megatron-LM or megapipe index .magic b'MMIDIDX\\x01"),
    (lambda data: b"GARBAGE!" + data[8:], "is not a Megatron-LM or megapipe index"),
    (lambda data: data[:-8] + struct.pack("<q", 3), "has document boundaries from 0 to 3 instead of 0 to"),
])
def test_corrupt_index_is_reported(dataset_prefix, transform, message):
    corrupt(dataset_prefix + ".idx", transform)
    with pytest.raises(DataError, match=message):
        IndexedDataset(dataset_prefix)


# format -> (offset of the version, its struct, offset of the dtype code, its struct)
HEADER_FIELDS = {"megatron": (9, "<Q", 17, "<B"), "megapipe": (8, "<I", 12, "<I")}


@pytest.mark.parametrize("field, value, message", [
    ("version", 2, "format version 2 but megapipe reads version 1"),
    ("dtype", 9, "has dtype code 9, which the .* format does not define"),
])
def test_wrong_version_or_unknown_dtype_code_is_reported(dataset_prefix, field, value, message):
    fmt = IndexedDataset(dataset_prefix).format
    version_at, version_struct, code_at, code_struct = HEADER_FIELDS[fmt]
    at, layout = (version_at, version_struct) if field == "version" else (code_at, code_struct)
    end = at + struct.calcsize(layout)
    corrupt(dataset_prefix + ".idx", lambda data: data[:at] + struct.pack(layout, value) + data[end:])
    with pytest.raises(DataError, match=message):
        IndexedDataset(dataset_prefix)


def test_megatron_multimodal_modes_are_accepted_and_other_extra_bytes_are_not(tmp_path, documents):
    prefix = write_dataset(str(tmp_path / "ds"), documents)
    n = sum(len(doc) for doc in documents)
    corrupt(prefix + ".idx", lambda data: data + bytes(n))
    assert [IndexedDataset(prefix).document(d).tolist() for d in range(len(documents))] == \
        [sum(doc, []) for doc in documents]
    corrupt(prefix + ".idx", lambda data: data + b"\x00")
    with pytest.raises(DataError, match=f"has {os.path.getsize(prefix + '.idx')} bytes but its header "
                                        rf"\({n} sequences, {len(documents) + 1} document boundaries\) needs"):
        IndexedDataset(prefix)


def test_truncated_bin_is_reported_as_index_pointing_past_its_end(dataset_prefix):
    size = os.path.getsize(dataset_prefix + ".bin")
    corrupt(dataset_prefix + ".bin", lambda data: data[:-2])
    with pytest.raises(DataError, match=f"points to byte {size} but .*has only {size - 2} bytes; "
                                        "the .bin is truncated"):
        IndexedDataset(dataset_prefix)


def test_bin_from_another_run_is_reported(dataset_prefix):
    corrupt(dataset_prefix + ".bin", lambda data: data + b"\x00\x00")
    with pytest.raises(DataError, match="come from different runs"):
        IndexedDataset(dataset_prefix)


def test_token_ids_beyond_the_vocabulary_are_reported_once(dataset_prefix):
    ds = IndexedDataset(dataset_prefix)
    largest = int(ds.tokens.max())
    IndexedDataset(dataset_prefix, vocab_size=largest + 1)
    with pytest.raises(DataError, match=f"holds token id {largest} but the tokenizer has only {largest} ids"):
        IndexedDataset(dataset_prefix, vocab_size=largest)
    ds.check_vocab(largest + 1)
    assert ds.__dict__["max_token_id"] == largest  # computed once, then cached on the dataset
