"""Whole-model access to checkpoints in one process, for tools (no process group).

``read_checkpoint`` assembles every tensor whole from whatever pieces were saved.
``write_checkpoint`` writes whole tensors back as the ranks of a chosen layout would have:
one file per rank holding that rank's pieces (replicas deduplicated as in a real save), then
publishes the directory atomically as training does. Each rank's pieces come from the real
model builder run on a tiny stand-in model (same layers, names and parallel attributes), so
the split always matches what training with that layout saves.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp

from megapipe.checkpointing.common import Common, SavedLayout
from megapipe.checkpointing.paths import find_checkpoint, prepare_staging, publish
from megapipe.checkpointing.planners import ShardSavePlanner
from megapipe.checkpointing.shards import Shard, cut
from megapipe.checkpointing.state import checkpointed_tensors, is_rank_local, model_key
from megapipe.checkpointing.storage import read_metadata, read_shards, saved_tensors
from megapipe.checkpointing.tokenizer_files import write_tokenizer
from megapipe.config import ModelConfig
from megapipe.data.tokenizer import Tokenizer
from megapipe.errors import CheckpointError
from megapipe.models import build_model_chunks
from megapipe.models.state_dict import canonical_name
from megapipe.parallel.state import ParallelState
from megapipe.layout.ranks import RankLayout
from megapipe.layout.placement import Placement

GROUPS = {"tensor": "tensor_groups", "data": "data_groups", "pipeline": "pipeline_groups",
          "model_parallel": "model_parallel_groups", "embedding": "embedding_groups"}


def read_checkpoint(path: str) -> tuple[str, Common, dict[str, torch.Tensor]]:
    """The checkpoint ``path`` names (a --save directory or an iter_* directory), every tensor whole."""
    directory = find_checkpoint(path)
    if directory is None:
        raise CheckpointError(f"{path} holds no checkpoint yet.")
    common = Common.read(directory)
    saved = saved_tensors(read_metadata(directory))
    shards = {key: Shard.whole(torch.empty(tuple(md.size), dtype=md.properties.dtype)) for key, md in saved.items()}
    read_shards(shards, directory, no_dist=True)
    return directory, common, {key: shard.local for key, shard in shards.items()}


def rank_state(layout: SavedLayout, rank: int) -> ParallelState:
    """The ParallelState of rank ``rank`` of ``layout``, without process groups."""
    ranks = RankLayout(layout.tensor, layout.pipeline, layout.data)
    state = ParallelState(ranks, rank, layout.virtual_pipeline, {name: None for name in GROUPS},
                          placement=Placement(layout.placement))
    for name, method in GROUPS.items():
        groups = ranks.embedding_groups(state.last_stage_pp_rank) if name == "embedding" else getattr(ranks, method)()
        state.members[name] = next((g for g in groups if rank in g), [])
    return state


def _stand_in(config: ModelConfig, t: int) -> ModelConfig:
    """The smallest model with ``config``'s layers and parameter names that splits ``t`` ways."""
    return dataclasses.replace(config, hidden_size=2 * t, num_attention_heads=t,
                               num_query_groups=t if config.num_query_groups else None, ffn_hidden_size=t,
                               rotary_percent=1.0, vocab_size=1, make_vocab_size_divisible_by=1, seq_length=1,
                               max_position_embeddings=1, params_dtype=torch.float32)


def rank_pieces(kind: str, config: ModelConfig, layout: SavedLayout, rank: int,
                tensors: dict[str, torch.Tensor]) -> dict[str, Shard]:
    """The pieces of ``tensors`` (whole, by checkpoint key) that ``rank`` of ``layout`` saves."""
    config.validate(layout.tensor, layout.pipeline, layout.virtual_pipeline)
    ps = rank_state(layout, rank)
    states: dict[str, list[str]] = {}  # parameter name -> its optimizer state keys
    for key in tensors:
        if key.startswith("optimizer/"):
            states.setdefault(key.removeprefix("optimizer/").rsplit("/", 1)[0], []).append(key)
    pieces = {}
    for chunk in build_model_chunks(kind, _stand_in(config, layout.tensor), ps):
        for name, param in checkpointed_tensors(chunk):
            canonical = canonical_name(name, param)
            if model_key(canonical) not in tensors:
                raise CheckpointError(f"the checkpoint has no tensor {model_key(canonical)!r}, which a "
                                      f"{kind.upper()} model with these settings needs.")
            for key in [model_key(canonical)] + states.get(canonical, []):
                whole = tensors[key]
                piece = Shard.whole(whole) if whole.dim() == 0 else cut(name, whole, param, ps, config)[1]
                if piece is not None:
                    pieces[key] = piece
    return pieces


def write_as_ranks(pieces: list[dict[str, Shard]], directory: str) -> None:
    """Write, in this one process, the files ``len(pieces)`` ranks saving one dict each would write.

    Runs DCP's save protocol (local plans, coordinator plan, writes, metadata) for every
    rank in turn instead of across processes.
    """
    planners = [ShardSavePlanner() for _ in pieces]
    writers = [dcp.FileSystemWriter(directory, sync_files=True) for _ in pieces]
    local_plans = []
    for rank, (planner, writer, shards) in enumerate(zip(planners, writers, pieces)):
        planner.set_up_planner(shards, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
    plans, metadata = planners[0].create_global_plan(local_plans)
    plans = writers[0].prepare_global_plan(plans)
    results = []
    for planner, writer, plan in zip(planners, writers, plans):
        future = writer.write_data(planner.finish_plan(plan), planner)
        future.wait()
        results.append(future.value())
    writers[0].finish(metadata=metadata, results=results)


def write_checkpoint(root: str, common: Common, tensors: dict[str, torch.Tensor], layout: SavedLayout,
                     tokenizer: Optional[Tokenizer]) -> str:
    """Write ``tensors`` (whole) and ``tokenizer`` under ``root`` as ``layout`` would have saved them; returns
    the directory.

    Random states and in-flight pipeline state are dropped (they belong to the ranks of the
    layout that made them).
    """
    tensors = {key: value for key, value in tensors.items() if not is_rank_local(key)}
    parallel = dict(common.config.get("parallel", {}), tensor=layout.tensor, pipeline=layout.pipeline,
                    data=layout.data, virtual_pipeline=layout.virtual_pipeline)
    common = dataclasses.replace(common, layout=layout, has_rng=False, config=dict(common.config, parallel=parallel))
    pieces = [rank_pieces(common.kind, common.model_config, layout, rank, tensors) for rank in range(layout.world_size)]
    os.makedirs(root, exist_ok=True)
    staging = prepare_staging(root, common.iteration)
    write_as_ranks(pieces, staging)
    common.tokenizer = write_tokenizer(tokenizer, staging)
    common.write(staging)
    return publish(root, common.iteration)
