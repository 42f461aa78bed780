"""Memory-mapped token datasets: a ``.bin`` of token ids and an ``.idx`` describing it.

A dataset is named by its path prefix: ``PREFIX.bin`` and ``PREFIX.idx``. It holds documents,
each a run of sequences (one sequence per document for GPT, one per sentence for BERT).

``PREFIX.bin`` is the token ids of every sequence, concatenated with no separators; megapipe
writes little-endian ``uint16`` when the vocabulary has at most 65,536 ids and ``int32``
otherwise, and reads any dtype Megatron-LM defines.

Two ``.idx`` formats are read, told apart by their magic, and both are written; Megatron-LM's
is the default, so datasets move between Megatron-LM and megapipe unchanged. Both are
little-endian, N sequences and D documents::

    Megatron-LM (megatron/core/datasets/indexed_dataset.py)   megapipe
    magic              bytes[9] "MMIDIDX" + two zero bytes    bytes[8] "MPIPEIDX"
    version            uint64 (1)                             uint32 (1)
    dtype code of .bin uint8: 1 uint8, 2 int8, 3 int16,         uint32: 1 uint16, 2 int32
                       4 int32, 5 int64, 6 float64,
                       7 float32, 8 uint16
    sequence count     uint64 N                               uint64 N
    document count     uint64 D + 1 (boundaries)              uint64 D
    sequence lengths   int32[N]                               int64[N]
    sequence pointers  int64[N], byte offset of each sequence in .bin
    boundaries         int64[D+1]: document d is sequences [b[d], b[d+1]); b[0] = 0, b[D] = N
    modes              int8[N], multimodal Megatron datasets only (ignored here)

so the ``.idx`` is exactly its header plus those arrays (34 + 12N + 8(D+1) bytes for Megatron-LM,
plus N with modes; 32 + 16N + 8(D+1) for megapipe) and the ``.bin`` exactly
``pointer[N-1] + itemsize*length[N-1]`` bytes (0 when N = 0). Every array is a zero-copy
view of one memory map of the ``.idx``.

``IndexedDatasetBuilder`` writes both files under temporary names and renames them into place
(``.bin`` first, then ``.idx``), so a reader never sees a half-written dataset.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence

import numpy as np

from megapipe.atomic_files import temporary_sibling
from megapipe.errors import DataError

RECREATE = "re-create it with tools/preprocess_data.py"


@dataclass(frozen=True)
class IndexFormat:
    """Where one ``.idx`` format keeps its fields: a header ``(magic, version, dtype code, N, count)``
    followed by the lengths, pointers and document boundaries (``count + extra_boundaries`` of them),
    then optionally ``optional_bytes_per_sequence * N`` bytes the reader skips (Megatron's modes)."""

    name: str
    header: struct.Struct
    magic: bytes
    dtype_codes: dict
    length_dtype: np.dtype
    extra_boundaries: int
    optional_bytes_per_sequence: int

    def array_bytes(self, n: int, boundaries: int) -> int:
        return self.header.size + n * (self.length_dtype.itemsize + 8) + 8 * boundaries

    def code_of(self, dtype: np.dtype) -> int:
        codes = [code for code, candidate in self.dtype_codes.items() if candidate == dtype]
        if not codes:
            raise ValueError(f"dtype {dtype} is not one of {list(self.dtype_codes.values())} ({self.name} format)")
        return codes[0]


MEGATRON = IndexFormat(
    name="megatron", header=struct.Struct("<9sQBQQ"), magic=b"MMIDIDX\x00\x00",
    dtype_codes={1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
                 5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2")},
    length_dtype=np.dtype("<i4"), extra_boundaries=0, optional_bytes_per_sequence=1)
MEGAPIPE = IndexFormat(
    name="megapipe", header=struct.Struct("<8sIIQQ"), magic=b"MPIPEIDX",
    dtype_codes={1: np.dtype("<u2"), 2: np.dtype("<i4")},
    length_dtype=np.dtype("<i8"), extra_boundaries=1, optional_bytes_per_sequence=0)
FORMATS = {fmt.name: fmt for fmt in (MEGATRON, MEGAPIPE)}
DEFAULT_FORMAT = MEGATRON.name
VERSION = 1
HEADER_PEEK = max(fmt.header.size for fmt in FORMATS.values())


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest .bin dtype that holds every id of a vocabulary of ``vocab_size`` tokens."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<i4")


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
        with open(path, "rb") as f:
            head = f.read(HEADER_PEEK)
        fmt = next((fmt for fmt in FORMATS.values() if head.startswith(fmt.magic)), None)
        if fmt is None:
            raise DataError(f"{path} is not a Megatron-LM or megapipe index (magic {head[:9]!r}, expected "
                            f"{MEGATRON.magic!r} or {MEGAPIPE.magic!r}); {RECREATE}.")
        if size < fmt.header.size:
            raise DataError(f"{path} is truncated ({size} bytes, shorter than its {fmt.header.size}-byte "
                            f"{fmt.name} header); {RECREATE}.")
        _, version, dtype_code, n, count = fmt.header.unpack(head[:fmt.header.size])
        if version != VERSION:
            raise DataError(f"{path} has {fmt.name} format version {version} but megapipe reads version {VERSION}; "
                            f"{RECREATE}.")
        if dtype_code not in fmt.dtype_codes:
            raise DataError(f"{path} has dtype code {dtype_code}, which the {fmt.name} format does not define "
                            f"(known: {', '.join(map(str, fmt.dtype_codes))}); {RECREATE}.")
        boundaries = count + fmt.extra_boundaries
        expected = fmt.array_bytes(n, boundaries)
        with_modes = expected + n * fmt.optional_bytes_per_sequence
        if size not in (expected, with_modes) or boundaries < 1:
            modes = f" ({with_modes} with multimodal modes)" if fmt.optional_bytes_per_sequence else ""
            raise DataError(f"{path} has {size} bytes but its header ({n} sequences, {boundaries} document "
                            f"boundaries) needs {expected}{modes}; the file is truncated or corrupt, {RECREATE}.")
        index = _memory_map(path, np.dtype(np.uint8), 0)
        offset = fmt.header.size
        arrays = []
        for dtype, length in ((fmt.length_dtype, n), (np.dtype("<i8"), n), (np.dtype("<i8"), boundaries)):
            arrays.append(np.frombuffer(index, dtype=dtype, count=length, offset=offset))
            offset += dtype.itemsize * length
        self.format = fmt.name
        self.dtype = fmt.dtype_codes[dtype_code]
        self.sequence_lengths, self.sequence_pointers, self.document_indices = arrays
        if self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise DataError(f"{path} has document boundaries from {self.document_indices[0]} to "
                            f"{self.document_indices[-1]} instead of 0 to {n}; {RECREATE}.")

    def _map_tokens(self, path: str) -> None:
        n = len(self.sequence_lengths)
        needed = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if n else 0
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

    ``output_format`` is ``"megatron"`` (Megatron-LM's ``.idx``, the default) or ``"megapipe"``.
    As a context manager it finalizes when the block ends normally and deletes the temporary
    files when the block raises.
    """

    def __init__(self, prefix: str, dtype: np.dtype, output_format: str = DEFAULT_FORMAT):
        if output_format not in FORMATS:
            raise ValueError(f"output format {output_format!r} is not one of {list(FORMATS)}")
        self.prefix = prefix
        self.format = FORMATS[output_format]
        self.dtype = np.dtype(dtype)
        self._code = self.format.code_of(self.dtype)
        if self.dtype.kind not in "iu":
            raise ValueError(f"dtype {self.dtype} cannot hold token ids; use an integer dtype")
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
            if ids.size > np.iinfo(self.format.length_dtype).max:
                raise DataError(f"a sequence of {ids.size} tokens is longer than the {self.format.name} format "
                                "stores; split it (--split-sentences) or write --output-format megapipe.")
            self._bin.write(ids.astype(self.dtype).tobytes())
            self._lengths.append(ids.size)
        self._document_indices.append(len(self._lengths))

    def finalize(self) -> None:
        """Write the index and rename both files to ``PREFIX.bin`` and ``PREFIX.idx``."""
        self._bin.close()
        fmt = self.format
        lengths = np.asarray(self._lengths, dtype="<i8")
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1]) * self.dtype.itemsize]).astype("<i8")[:len(lengths)]
        boundaries = np.asarray(self._document_indices, dtype="<i8")
        header = fmt.header.pack(fmt.magic, VERSION, self._code, len(lengths), len(boundaries) - fmt.extra_boundaries)
        idx_tmp = temporary_sibling(idx_path(self.prefix))
        with open(idx_tmp, "xb") as f:
            f.write(header)
            for array in (lengths.astype(fmt.length_dtype), pointers, boundaries):
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
