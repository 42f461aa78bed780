"""Turn a plan into what the training scripts take: a plan file and the exact torchrun command.

The plan file holds ``{"stages": [{"layers": [start, end], "replicas": r}, ...]}`` (transformer
layers, end exclusive; the first stage also runs the embedding, the last the head) plus the
settings that go with it, as ``--pipeline-stages`` reads it. A uniform layout lists its p
stages with d replicas each; a PipeDream partition lists its stages with their own replication
factors, as ``--pipeline-stages 0:12x2,12:24x1`` does. An interleaved layout cannot be written
as stages (a rank holds v separate layer ranges), so its file lists ``model_chunks`` instead and
is run by its command. 2BW and PipeDream pipelines get ``--untie-embeddings-and-output-weights``
(``unties_embeddings``). A searched schedule (``auto``) is run with the ranks' predicted times
as ``--schedule-*-time`` flags, so the training scripts search the same schedule.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from megapipe.layout.stage_plan import equal_split, layers_per_stage
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import Estimate
from megapipe.planner.partition import Partition
from megapipe.planner.profile import ModelShape
from megapipe.planner.schedule_costs import SEARCHED, unties_embeddings
from megapipe.schedules.catalog import pipedream

PIPEDREAM = pipedream.DESCRIPTOR.name


def pipeline_stages_flag(stages: list[tuple[int, int, int]]) -> str:
    """``start:endxreplicas`` per stage, comma separated."""
    return ",".join(f"{start}:{end}x{replicas}" for start, end, replicas in stages)


def model_flags(shape: ModelShape, untie: bool = False) -> list[str]:
    """The shape's flags; ``untie`` gives a tied model separate input and output embeddings."""
    flags = ["--num-layers", shape.num_layers, "--hidden-size", shape.hidden_size,
             "--num-attention-heads", shape.num_attention_heads, "--seq-length", shape.seq_length,
             "--max-position-embeddings", shape.seq_length]
    if shape.ffn_hidden_size != 4 * shape.hidden_size:
        flags += ["--ffn-hidden-size", shape.ffn_hidden_size]
    if untie or not shape.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if shape.is_moe:  # megapipe's experts have no biases
        flags += ["--disable-bias-linear", "--num-experts", shape.num_experts, "--moe-router-topk", shape.moe_router_topk]
        if shape.moe_ffn_hidden_size:
            flags += ["--moe-ffn-hidden-size", shape.moe_ffn_hidden_size]
        if shape.moe_layer_freq != 1:
            freq = shape.moe_layer_freq
            flags += ["--moe-layer-freq", freq if isinstance(freq, int) else ",".join(map(str, freq))]
    return [str(flag) for flag in flags]


def torchrun_prefix(cluster: Cluster, devices: Optional[int] = None) -> list[str]:
    """torchrun for ``devices`` processes (default: the whole cluster), rendezvous on $MASTER_ADDR across nodes."""
    devices = devices or cluster.num_gpus
    nodes = -(-devices // cluster.gpus_per_node)
    per_node = min(devices, cluster.gpus_per_node)
    words = ["torchrun", "--nnodes", str(nodes), "--nproc_per_node", str(per_node)]
    if nodes > 1:
        words += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "$MASTER_ADDR:29500"]
    return words


def _join(words: list[str]) -> str:
    return " ".join(word if word.startswith("$") else shlex.quote(word) for word in words)


def _seconds(times) -> str:
    return ",".join(f"{t:.6g}" for t in times)


def _script(shape: ModelShape) -> str:
    return f"pretrain_{shape.kind}.py"


def torchrun_command(estimate: Estimate, shape: ModelShape, cluster: Cluster, global_batch_size: int,
                     overlap: bool = False) -> str:
    """The training command of ``estimate``'s candidate; ``overlap``: it was planned with overlapped reductions."""
    candidate = estimate.candidate
    untie = unties_embeddings(candidate.schedule, candidate.pipeline)
    words = torchrun_prefix(cluster) + [_script(shape)] + model_flags(shape, untie) + [
        "--tensor-model-parallel-size", str(candidate.tensor), "--pipeline-model-parallel-size", str(candidate.pipeline),
        "--micro-batch-size", str(candidate.micro_batch_size), "--global-batch-size", str(global_batch_size),
        "--pipeline-schedule", candidate.schedule, "--data-parallel-sharding-strategy", candidate.sharding]
    if candidate.sequence_parallel and candidate.tensor > 1:
        words += ["--sequence-parallel"]
    if candidate.expert > 1:
        words += ["--expert-model-parallel-size", str(candidate.expert)]
    if candidate.expert_tensor is not None:
        words += ["--expert-tensor-parallel-size", str(candidate.expert_tensor)]
    if candidate.overlap_moe_comm:
        words += ["--overlap-moe-expert-parallel-comm"]
    if candidate.context > 1:  # attention dropout cannot be split over key blocks
        words += ["--context-parallel-size", str(candidate.context), "--cp-comm-type", candidate.cp_comm_type,
                  "--attention-dropout", "0"]
    if candidate.virtual > 1:
        words += ["--num-layers-per-virtual-pipeline-stage", str(layers_per_stage(shape.num_layers, candidate.pipeline * candidate.virtual))]
    if candidate.schedule == SEARCHED:  # the search on the training side, for the times the plan predicted
        forward, backward = estimate.rank_times
        halves = _seconds([b / 2 for b in backward])
        words += ["--schedule-forward-time", _seconds(forward), "--schedule-input-backward-time", halves,
                  "--schedule-weight-backward-time", halves]
    if candidate.recompute:
        words += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", str(estimate.recompute_layers)]
    if overlap:
        words += ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if candidate.sharding != "no_shard" else [])
    return _join(words)


def uniform_stages(estimate: Estimate, shape: ModelShape) -> list[tuple[int, int, int]]:
    candidate = estimate.candidate
    plan = equal_split(shape.num_layers, candidate.pipeline * candidate.virtual, candidate.data)
    return [(start, end, candidate.data) for start, end in plan.layer_ranges]


def uniform_plan(estimate: Estimate, shape: ModelShape, cluster: Cluster, global_batch_size: int,
                 overlap: bool = False) -> dict:
    candidate = estimate.candidate
    stages = uniform_stages(estimate, shape)
    listed = [{"layers": [a, b], "replicas": r} for a, b, r in stages]
    document = {
        "schedule": candidate.schedule,
        "micro_batch_size": candidate.micro_batch_size,
        "global_batch_size": global_batch_size,
        "tensor_model_parallel_size": candidate.tensor,
        "pipeline_model_parallel_size": candidate.pipeline,
        "data_parallel_size": candidate.data,
        "data_parallel_sharding_strategy": candidate.sharding,
        "expert_model_parallel_size": candidate.expert,
        "expert_tensor_parallel_size": candidate.etp,
        "overlap_moe_expert_parallel_comm": candidate.overlap_moe_comm,
        "context_parallel_size": candidate.context,
        "cp_comm_type": candidate.cp_comm_type,
        "microbatches_per_pipeline": estimate.microbatches,
        "recompute": ({"granularity": "full", "method": "uniform", "num_layers": estimate.recompute_layers}
                      if candidate.recompute else None),
        "predicted": {"samples_per_second": estimate.samples_per_second, "batch_time_s": estimate.batch_time,
                      "memory_bytes_per_device": estimate.memory, "bubble": estimate.bubble,
                      "model_flops_per_device": estimate.flops_per_gpu},
        "model": asdict(shape),
        "cluster": cluster.to_dict(),
        "command": torchrun_command(estimate, shape, cluster, global_batch_size, overlap),
    }
    if candidate.virtual > 1:
        document["model_chunks"] = [dict(chunk, rank=k % candidate.pipeline) for k, chunk in enumerate(listed)]
        document["num_layers_per_virtual_pipeline_stage"] = layers_per_stage(shape.num_layers, candidate.pipeline * candidate.virtual)
    else:
        document["stages"] = listed
        document["pipeline_stages"] = pipeline_stages_flag(stages)
    return document


def pipedream_plan(partition: Partition, shape: ModelShape, cluster: Cluster, micro_batch_size: int) -> dict:
    """A PipeDream plan: stages with their own replication, NOAM, predicted time per microbatch.

    Weights are updated after every microbatch, so a step's batch is one microbatch per input-stage replica.
    """
    stages = [(s.start, s.end, s.replicas) for s in partition.stages]
    flag = pipeline_stages_flag(stages)
    batch = micro_batch_size * partition.stages[0].replicas
    untie = unties_embeddings(PIPEDREAM, len(stages))
    command = _join(torchrun_prefix(cluster, partition.workers) + [_script(shape)] + model_flags(shape, untie) + [
        "--pipeline-stages", flag, "--micro-batch-size", str(micro_batch_size), "--global-batch-size", str(batch),
        "--pipeline-schedule", PIPEDREAM])
    return {
        "stages": [{"layers": [a, b], "replicas": r, "in_flight": s.in_flight}
                   for (a, b, r), s in zip(stages, partition.stages)],
        "schedule": PIPEDREAM,
        "micro_batch_size": micro_batch_size,
        "global_batch_size": batch,
        "tensor_model_parallel_size": 1,
        "noam": partition.noam,
        "config": partition.config_name,
        "predicted": {"time_per_microbatch_s": partition.time_per_input,
                      "samples_per_second": micro_batch_size / partition.time_per_input},
        "model": asdict(shape),
        "cluster": cluster.to_dict(),
        "pipeline_stages": flag,
        "command": command,
    }


def write_plan(document: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(document, indent=1) + "\n")
