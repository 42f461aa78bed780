"""Documents from local files: JSON lines, plain text and Parquet, chosen by file extension.

Each document is a dict ``{key: text}``. JSONL and Parquet give one document per line/row with
the ``--json-keys`` fields (columns); plain text gives the key ``text`` with one document per
non-blank line (without its line ending) or, with ``document_per_file``, one per file (its exact
content, line endings included).
"""

from __future__ import annotations

import json
import os
from typing import Iterator, Sequence

from megapipe.errors import ConfigError, DataError
from megapipe.optional import require

JSONL_EXTENSIONS = (".jsonl", ".json")
PARQUET_EXTENSIONS = (".parquet",)
TEXT_KEY = "text"


def input_format(path: str) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"``, from the file name."""
    if path.endswith(JSONL_EXTENSIONS):
        return "jsonl"
    if path.endswith(PARQUET_EXTENSIONS):
        return "parquet"
    return "text"


def output_keys(paths: Sequence[str], json_keys: Sequence[str]) -> list[str]:
    """The keys every document will have; plain text only offers ``text``."""
    if any(input_format(p) == "text" for p in paths) and list(json_keys) != [TEXT_KEY]:
        raise ConfigError(f"--json-keys {' '.join(json_keys)} only applies to JSONL and Parquet input; "
                          f"plain text files give the single key '{TEXT_KEY}', so drop the flag.")
    return list(json_keys)


def _read_jsonl(path: str, keys: Sequence[str]) -> Iterator[dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_number} is not valid JSON ({error.msg}); "
                                "each line of a JSONL file must be one JSON object.") from None
            yield {key: _text_field(record, key, f"{path}:{line_number}") for key in keys}


def _text_field(record, key: str, where: str) -> str:
    if not isinstance(record, dict) or key not in record:
        found = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} has no key '{key}' (found: {found}); pass the right field with --json-keys.")
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where} key '{key}' holds {type(value).__name__}, not text; "
                        "pass a text field with --json-keys.")
    return value


def _read_text(path: str, document_per_file: bool) -> Iterator[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:  # keep \r\n as written: files round-trip byte for byte
        if document_per_file:
            yield {TEXT_KEY: f.read()}
            return
        for line in f:
            line = line.rstrip("\r\n")
            if line.strip():
                yield {TEXT_KEY: line}


def _read_parquet(path: str, keys: Sequence[str]) -> Iterator[dict[str, str]]:
    datasets = require("datasets", "Reading Parquet input")
    rows = datasets.load_dataset("parquet", data_files=[path], split="train", streaming=True)
    for row_number, row in enumerate(rows):
        yield {key: _text_field(row, key, f"{path} row {row_number}") for key in keys}


def read_documents(paths: Sequence[str], json_keys: Sequence[str] = (TEXT_KEY,),
                   document_per_file: bool = False) -> Iterator[dict[str, str]]:
    """Every document of every input file, in order."""
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"--input {path} does not exist or is not a file; "
                            "pass a local JSONL, text or Parquet file.")
    for path in paths:
        kind = input_format(path)
        try:
            if kind == "jsonl":
                yield from _read_jsonl(path, json_keys)
            elif kind == "parquet":
                yield from _read_parquet(path, json_keys)
            else:
                yield from _read_text(path, document_per_file)
        except UnicodeDecodeError as error:
            raise DataError(f"--input {path} is not UTF-8 text (bad byte at offset {error.start}); "
                            "convert it to UTF-8 first.") from None
