"""``--hf-dataset PATH``: the documents of a local Hugging Face dataset, opened once and checked.

PATH is a folder written by ``Dataset.save_to_disk`` or a folder of data files of one format
(``*.parquet``, ``*.jsonl``/``*.json``, ``*.arrow``, read in name order). Files are converted
by ``datasets.load_dataset`` into its Arrow cache (``cache_dir``, else the ``datasets`` default),
offline; a saved dataset is memory-mapped as it is. Either way the text is read by index without
loading the whole dataset into memory. ``datasets`` is an optional package, imported here only.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

from megapipe.errors import DataError
from megapipe.optional import require

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
SAVED_MARKERS = ("state.json", "dataset_info.json")  # what save_to_disk writes next to the Arrow files
EMPTY = "add data or pass another dataset"
ADVICE = "pass a folder written by Dataset.save_to_disk or a folder of Parquet, JSONL or Arrow files"


def _data_files(path: str) -> tuple[str, list[str]]:
    """The ``load_dataset`` builder and the data files of a folder of files, or DataError."""
    names = sorted(os.listdir(path))
    formats = {FORMATS[ext] for ext in (os.path.splitext(n)[1] for n in names) if ext in FORMATS}
    if not formats:
        raise DataError(f"--hf-dataset {path} is not a dataset (no Parquet, JSONL or Arrow files, no save_to_disk "
                        f"files); {ADVICE}.")
    if len(formats) > 1:
        raise DataError(f"--hf-dataset {path} mixes {' and '.join(sorted(formats))} files; keep one format per "
                        "dataset folder.")
    files = [os.path.join(path, n) for n in names if os.path.splitext(n)[1] in FORMATS]
    if not any(os.path.getsize(f) for f in files):  # datasets fails on these with a bare StopIteration
        raise DataError(f"--hf-dataset {path} holds no documents (its files are empty); {EMPTY}.")
    return formats.pop(), files


def _saved_shards(path: str) -> list:
    """The Arrow files a save_to_disk folder lists."""
    try:
        with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
            return json.load(f).get("_data_files", [])
    except (OSError, ValueError, AttributeError):
        raise DataError(f"--hf-dataset {path} has an unreadable state.json; save the dataset again with "
                        "save_to_disk.") from None


def _load(path: str, cache_dir: Optional[str]):
    datasets = require("datasets", "--hf-dataset")
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        splits = ", ".join(sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))))
        raise DataError(f"--hf-dataset {path} holds several splits ({splits}); pass the folder of one of them, "
                        f"e.g. {os.path.join(path, 'train')}.")
    if all(os.path.isfile(os.path.join(path, name)) for name in SAVED_MARKERS):
        if not _saved_shards(path):  # what save_to_disk writes for no rows, which load_from_disk cannot read
            raise DataError(f"--hf-dataset {path} holds no documents; {EMPTY}.")
        return _reading(path, datasets, lambda: datasets.load_from_disk(path))
    builder, files = _data_files(path)
    return _reading(path, datasets, lambda: datasets.load_dataset(builder, data_files=files, split="train",
                                                                   cache_dir=cache_dir))


def _reading(path: str, datasets, load: Callable):
    """``load()``, its failures to read the files said as one DataError."""
    try:
        return load()
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"--hf-dataset {path} cannot be read as a dataset ({reason}); {ADVICE}.") from None


def open_hf_dataset(path: str, text_key: str, cache_dir: Optional[str] = None):
    """The ``datasets.Dataset`` at ``path`` reduced to its ``text_key`` column, with at least one document.

    DataError, one sentence each, for: a path that is not a dataset, a dataset without the text
    column (naming the columns it has) or whose column is not text, and an empty dataset.
    """
    if not os.path.isdir(path):
        raise DataError(f"--hf-dataset {path} is not a folder; {ADVICE}.")
    dataset = _load(path, cache_dir)
    if text_key not in dataset.column_names:
        raise DataError(f"--hf-dataset {path} has no column '{text_key}' (its columns: "
                        f"{', '.join(dataset.column_names)}); name the text column with --hf-dataset-text-key.")
    kind = getattr(dataset.features[text_key], "dtype", None)
    if kind not in ("string", "large_string"):
        raise DataError(f"--hf-dataset {path} column '{text_key}' holds {kind or dataset.features[text_key]}, not "
                        "text; name the text column with --hf-dataset-text-key.")
    if len(dataset) == 0:
        raise DataError(f"--hf-dataset {path} holds no documents; {EMPTY}.")
    return dataset.select_columns([text_key])
