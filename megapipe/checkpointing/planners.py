"""torch.distributed.checkpoint planners for a flat dict of ``Shard`` values.

Saving: every rank plans one write per shard, with the shard's offsets and the tensor's
global shape; the coordinator drops duplicates (replicas on other data or tensor ranks, the
tied embedding's copy on the last stage) and checks that the pieces of each tensor neither
overlap nor leave holes. Loading: every rank asks for the blocks its shards cover and the
reader copies the overlapping parts of whatever pieces were saved, so any layout can read
any other's files.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megapipe.checkpointing.shards import Shard


def _chunk(shard: Shard) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(shard.offsets), sizes=shard.local.size())


def _write_item(key: str, shard: Shard) -> WriteItem:
    return WriteItem(index=MetadataIndex(key, torch.Size(shard.offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=_chunk(shard),
                                                 properties=TensorProperties.create_from_tensor(shard.local),
                                                 size=torch.Size(shard.global_shape)))


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or a copy when it is a view (torch.save would write the whole storage)."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


class ShardSavePlanner(DefaultSavePlanner):
    """Writes ``{key: Shard}``; deduplication and the global checks are DCP's own."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([_write_item(key, shard) for key, shard in self.state_dict.items()])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return _own_storage(self.state_dict[index.fqn].local)


class ShardLoadPlanner(DefaultLoadPlanner):
    """Reads into ``{key: Shard}``: each shard's ``local`` receives its block of the saved tensor."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up rewrites values it does not know (ours are Shards); keep them as given.
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, shard in self.state_dict.items():
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [_chunk(shard)])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].local
