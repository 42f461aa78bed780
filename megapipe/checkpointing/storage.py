"""Reading and writing shard files through torch.distributed.checkpoint (DCP).

DCP writes one file per rank (``__<rank>_0.distcp``, each file synced) and, on the
coordinator, ``.metadata``: every tensor's global shape and, for every saved piece, its
offsets and the byte range of the file that holds it. Failures come back as one
``CheckpointError`` sentence instead of DCP's per-rank tracebacks.
"""

from __future__ import annotations

import os
import pickle
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from megapipe.checkpointing.paths import METADATA
from megapipe.checkpointing.planners import ShardLoadPlanner, ShardSavePlanner
from megapipe.checkpointing.shards import Shard
from megapipe.errors import CheckpointError


def _first_failure(error: CheckpointException) -> str:
    """The lowest failing rank and the first sentence of its exception, ending in a full stop."""
    rank, (exception, _) = min(error.failures.items())
    first = str(exception).splitlines()[0].split(". ")[0].rstrip(".") if str(exception) else ""
    return f"rank {rank}: {type(exception).__name__}: {first}."


def write_shards(shards: dict[str, Shard], directory: str, process_group=None, no_dist: bool = False) -> None:
    """Write this rank's pieces into ``directory`` (collective over ``process_group`` unless ``no_dist``)."""
    try:
        dcp.save(shards, storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
                 planner=ShardSavePlanner(), process_group=process_group, no_dist=no_dist)
    except CheckpointException as error:
        raise CheckpointError(f"writing the checkpoint into {directory} failed on {_first_failure(error)}") from None


def read_shards(shards: dict[str, Shard], directory: str, process_group=None, no_dist: bool = False) -> None:
    """Fill each shard's block from the pieces saved in ``directory``, whatever layout wrote them."""
    try:
        with warnings.catch_warnings():  # DCP warns that no_dist means one process, which is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(shards, storage_reader=dcp.FileSystemReader(directory), planner=ShardLoadPlanner(),
                     process_group=process_group, no_dist=no_dist)
    except CheckpointException as error:
        raise CheckpointError(f"reading checkpoint {directory} failed on {_first_failure(error)}") from None


def read_metadata(directory: str) -> Metadata:
    """The checkpoint's index of tensors and pieces, after checking that every file it names is whole."""
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory} is incomplete: it has no {METADATA} file.") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as error:
        raise CheckpointError(f"checkpoint {directory} is damaged: its {METADATA} file cannot be read "
                              f"({type(error).__name__}).") from None
    _check_files(directory, metadata)
    return metadata


def _check_files(directory: str, metadata: Metadata) -> None:
    """Every shard file exists and is at least as long as the last piece it should hold."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint {directory} is incomplete: shard file {name} is missing.")
        actual = os.path.getsize(path)
        if actual < size:
            raise CheckpointError(f"checkpoint {directory} is damaged: shard file {name} is truncated "
                                  f"({actual} bytes, the index needs {size}).")


def saved_tensors(metadata: Metadata) -> dict:
    """Checkpoint key -> TensorStorageMetadata (global size, dtype, pieces)."""
    return dict(metadata.state_dict_metadata)
