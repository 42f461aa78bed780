"""Memory-mapped token datasets: a ``.bin`` of token ids and an ``.idx`` describing it.

A dataset is named by its path prefix: ``PREFIX.bin`` and ``PREFIX.idx``. It holds documents,
each a run of sequences (one sequence per document for GPT, one per sentence for BERT).

``PREFIX.bin`` is the token ids of every sequence, concatenated with no separators, as
little-endian ``uint16`` when the vocabulary has at most 65,536 ids and ``int32`` otherwise.

``PREFIX.idx`` is little-endian throughout (N sequences, D documents)::

    offset        size     type          field
    0             8        bytes         magic b"MPIPEIDX"
    8             4        uint32        format version (1)
    12            4        uint32        dtype code of .bin: 1 = uint16, 2 = int32
    16            8        uint64        N, the number of sequences
    24            8        uint64        D, the number of documents
    32            8*N      int64[N]      sequence lengths, in tokens
    32+8N         8*N      int64[N]      sequence pointers: byte offset of each sequence in .bin
    32+16N        8*(D+1)  int64[D+1]    document boundaries: document d is sequences
                                         [b[d], b[d+1]); b[0] = 0 and b[D] = N

so the ``.idx`` is exactly ``32 + 8*(2N + D + 1)`` bytes and the ``.bin`` exactly
``pointer[N-1] + itemsize*length[N-1]`` bytes (0 when N = 0). Every int64 array starts on an
8-byte boundary, so all three are read as zero-copy ``numpy`` memory maps.

``IndexedDatasetBuilder`` writes both files under temporary names and renames them into place
(``.bin`` first, then ``.idx``), so a reader never sees a half-written dataset.
"""

from __future__ import annotations

import os
import struct
from functools import cached_property
from typing import Optional, Sequence

import numpy as np

from megapipe.data.atomic import temporary_sibling
from megapipe.errors import DataError

MAGIC = b"MPIPEIDX"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")
DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest .bin dtype that holds every id of a vocabulary of ``vocab_size`` tokens."""
    return DTYPE_CODES[1] if vocab_size <= 65536 else DTYPE_CODES[2]


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def check_prefix_exists(prefix: str, flag: str = "--data-path") -> None:
    """Raise DataError naming both files when either half of a dataset is missing."""
    missing = [path for path in (bin_path(prefix), idx_path(prefix)) if not os.path.isfile(path)]
    if missing:
        hint = " (give the prefix without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
        raise DataError(f"{flag} prefix {prefix} not found{hint}: looked for {bin_path(prefix)} and "
                        f"{idx_path(prefix)}, missing {' and '.join(missing)}; "
                        "create them with tools/preprocess_data.py.")


def _memory_map(path: str, dtype: np.dtype, offset: int) -> np.ndarray:
    """Read-only zero-copy view of a file from ``offset`` on, as a plain ndarray (slices of a
    ``np.memmap`` subclass cost several times more); an empty file gives an empty array."""
    if os.path.getsize(path) <= offset:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset).view(np.ndarray)


class IndexedDataset:
    """Read-only view of a dataset: ``len(ds)`` sequences, ``ds[i]`` a zero-copy array of ids.

    With ``vocab_size``, opening checks that no token id reaches it (one max over the tokens,
    cached in ``max_token_id``), so a dataset preprocessed with another tokenizer fails here
    instead of as an index error deep inside the embedding.
    """

    def __init__(self, prefix: str, vocab_size: Optional[int] = None):
        check_prefix_exists(prefix)
        self.prefix = prefix
        self._read_index(idx_path(prefix))
        self._map_tokens(bin_path(prefix))
        if vocab_size is not None:
            self.check_vocab(vocab_size)

    def _read_index(self, path: str) -> None:
        size = os.path.getsize(path)
        if size < HEADER.size:
            raise DataError(f"{path} is truncated ({size} bytes, shorter than its {HEADER.size}-byte header); "
                            "re-create it with tools/preprocess_data.py.")
        with open(path, "rb") as f:
            magic, version, dtype_code, n, d = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise DataError(f"{path} is not a megapipe index (magic {magic!r}, expected {MAGIC!r}); "
                            "re-create it with tools/preprocess_data.py.")
        if version != VERSION or dtype_code not in DTYPE_CODES:
            raise DataError(f"{path} has format version {version} and dtype code {dtype_code}, which this "
                            f"megapipe (version {VERSION}) cannot read; re-create it with tools/preprocess_data.py.")
        expected = HEADER.size + 8 * (2 * n + d + 1)
        if size != expected:
            raise DataError(f"{path} has {size} bytes but its header ({n} sequences, {d} documents) needs "
                            f"{expected}; the file is truncated or corrupt, "
                            "re-create it with tools/preprocess_data.py.")
        index = _memory_map(path, np.dtype("<i8"), HEADER.size)
        self.dtype = DTYPE_CODES[dtype_code]
        self.sequence_lengths = index[:n]
        self.sequence_pointers = index[n:2 * n]
        self.document_indices = index[2 * n:]
        if self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise DataError(f"{path} has document boundaries from {self.document_indices[0]} to "
                            f"{self.document_indices[-1]} instead of 0 to {n}; "
                            "re-create it with tools/preprocess_data.py.")

    def _map_tokens(self, path: str) -> None:
        n = len(self.sequence_lengths)
        needed = int(self.sequence_pointers[-1] + self.sequence_lengths[-1] * self.dtype.itemsize) if n else 0
        size = os.path.getsize(path)
        if size < needed:
            raise DataError(f"{idx_path(self.prefix)} points to byte {needed} but {path} has only {size} bytes; "
                            "the .bin is truncated, re-create the dataset with tools/preprocess_data.py.")
        if size > needed:
            raise DataError(f"{path} has {size} bytes but {idx_path(self.prefix)} describes {needed}; the two files "
                            "come from different runs, re-create the dataset with tools/preprocess_data.py.")
        self.tokens = _memory_map(path, self.dtype, 0)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset`` to ``offset + length`` of sequence ``i`` (to its end by default)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        stop = start - offset + int(self.sequence_lengths[i]) if length is None else start + length
        return self.tokens[start:stop]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @cached_property
    def document_lengths(self) -> np.ndarray:
        """Tokens in each document (all of its sequences)."""
        sequence_ends = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return sequence_ends[self.document_indices[1:]] - sequence_ends[self.document_indices[:-1]]

    @cached_property
    def document_starts(self) -> np.ndarray:
        """Offset in ``tokens`` of each document's first token (sequences of a document are contiguous)."""
        first = np.minimum(self.document_indices[:-1], max(len(self) - 1, 0))
        return self.sequence_pointers[first] // self.dtype.itemsize if len(self) else np.zeros(0, np.int64)

    def document(self, d: int) -> np.ndarray:
        """All tokens of document ``d``."""
        start = int(self.document_starts[d])
        return self.tokens[start:start + int(self.document_lengths[d])]

    @cached_property
    def max_token_id(self) -> int:
        """Largest token id in the dataset (-1 when empty); one pass over the memory map."""
        return int(self.tokens.max()) if len(self.tokens) else -1

    def check_vocab(self, vocab_size: int) -> None:
        if self.max_token_id >= vocab_size:
            raise DataError(f"{bin_path(self.prefix)} holds token id {self.max_token_id} but the tokenizer has only "
                            f"{vocab_size} ids; preprocess the data with the tokenizer you train with.")


class IndexedDatasetBuilder:
    """Appends documents to a new dataset, then ``finalize()`` moves it into place atomically.

    As a context manager it finalizes when the block ends normally and deletes the temporary
    files when the block raises.
    """

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES.values():
            raise ValueError(f"dtype {self.dtype} is not one of {list(DTYPE_CODES.values())}")
        self._max_id = np.iinfo(self.dtype).max
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin_tmp = temporary_sibling(bin_path(prefix))
        self._bin = open(self._bin_tmp, "xb")
        self._lengths: list[int] = []
        self._document_indices = [0]
        self._finalized = False

    def add_document(self, sequences: Sequence[Sequence[int]]) -> None:
        """Append one document made of ``sequences`` (a list of token-id lists or arrays)."""
        for sequence in sequences:
            ids = np.asarray(sequence, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() > self._max_id):
                raise DataError(f"token id {ids.max() if ids.max() > self._max_id else ids.min()} does not fit the "
                                f"dataset dtype {self.dtype}; the tokenizer's vocabulary is larger than declared.")
            self._bin.write(ids.astype(self.dtype).tobytes())
            self._lengths.append(ids.size)
        self._document_indices.append(len(self._lengths))

    def finalize(self) -> None:
        """Write the index and rename both files to ``PREFIX.bin`` and ``PREFIX.idx``."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype="<i8")
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1]) * self.dtype.itemsize]).astype("<i8")[:len(lengths)]
        code = next(c for c, dt in DTYPE_CODES.items() if dt == self.dtype)
        header = HEADER.pack(MAGIC, VERSION, code, len(lengths), len(self._document_indices) - 1)
        idx_tmp = temporary_sibling(idx_path(self.prefix))
        with open(idx_tmp, "xb") as f:
            f.write(header)
            for array in (lengths, pointers, np.asarray(self._document_indices, dtype="<i8")):
                f.write(array.tobytes())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(idx_tmp, idx_path(self.prefix))
        self._finalized = True

    def discard(self) -> None:
        """Drop everything written so far."""
        self._bin.close()
        if os.path.exists(self._bin_tmp):
            os.remove(self._bin_tmp)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
        elif not self._finalized:
            self.finalize()
