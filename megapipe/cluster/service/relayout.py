"""Re-planning a job for each allocation: the planner picks (t, p, d, schedule) for the hosts it got.

An allocation is hosts with some devices of one accelerator type each. The planner (Algorithm 1
over a closed-form profile of the job's model) ranks the flush layouts for that many nodes of
that many devices, at the type's relative speed; the job is launched with the best one, and its
checkpoint, written in whatever layout it ran before, is resharded on load. Only flush schedules,
no ZeRO sharding and the submitted micro-batch size are considered: they all compute the same
gradients from the same microbatches, so losses stay continuous across a re-layout (to
rounding), and a job whose layout stays the one it was submitted with resumes bit for bit. The
same plan's predicted iterations/s stand in for the job's throughput on a type until it has been
measured there.
"""

from __future__ import annotations

import dataclasses

from megapipe.cluster.service.backends.base import HostSlots
from megapipe.cluster.service.job_spec import JobSpec
from megapipe.cluster.core.throughputs import planner_steps_per_second
from megapipe.data.rank_data import run_tokenizer
from megapipe.errors import ConfigError
from megapipe.layout.stage_plan import layers_per_stage
from megapipe.planner.analytic import analytic_gpt_profile
from megapipe.planner.cluster import Cluster
from megapipe.planner.plan import PlanRequest, plan
from megapipe.planner.profile import ModelShape
from megapipe.planner.schedule_costs import FLUSHING

# one CPU device (a process on one core): fp32 GEMM rate, memory, and the links between processes
# on one host (shared memory) and between hosts (loopback or a veth pair between namespaces)
CPU_DEVICE = dict(memory_per_gpu=8 * 2 ** 30, intra_node_bandwidth=2e9, inter_node_bandwidth=5e8,
                  intra_node_latency=5e-5, inter_node_latency=2e-4)
CPU_FLOPS = 1e10
LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--pipeline-schedule",
                "--num-layers-per-virtual-pipeline-stage")


def _shape(spec: JobSpec) -> ModelShape:
    """The job's model shape, with the vocabulary of the tokenizer its run would use (as the trainer sets it)."""
    model = dataclasses.replace(spec.config.model, vocab_size=run_tokenizer(spec.kind, spec.config).vocab_size)
    return ModelShape.from_config(spec.kind, model)


def _cluster(hosts: tuple[HostSlots, ...], speed: float) -> Cluster:
    """``hosts`` (equal devices on each) as the planner's cluster, at relative ``speed``."""
    return Cluster(nodes=len(hosts), gpus_per_node=hosts[0].devices, compute_speed=speed,
                   name=hosts[0].worker_type, **CPU_DEVICE)


def _request(spec: JobSpec) -> PlanRequest:
    return PlanRequest(spec.config.training.global_batch_size, schedules=FLUSHING, recompute=(False,),
                       shardings=("no_shard",), micro_batch_sizes=(spec.config.training.micro_batch_size,))


def _profile(spec: JobSpec):
    return analytic_gpt_profile(_shape(spec), CPU_FLOPS, dtype="float32")


def best_layout(spec: JobSpec, hosts: tuple[HostSlots, ...], speed: float):
    """The planner's best flush layout for ``hosts`` (equal devices on each) at relative ``speed``."""
    return plan(_profile(spec), _cluster(hosts, speed), _request(spec)).best


def layout_command(spec: JobSpec, hosts: tuple[HostSlots, ...], speed: float) -> list[str]:
    """The submitted command with the planner's candidate for ``hosts``; the submitted candidate if none fits."""
    try:
        candidate = best_layout(spec, hosts, speed).candidate
    except ConfigError:
        return list(spec.command)
    flags = _without(spec.command[1:], LAYOUT_FLAGS)
    flags += ["--tensor-model-parallel-size", str(candidate.tensor), "--pipeline-model-parallel-size",
              str(candidate.pipeline), "--pipeline-schedule", candidate.schedule]
    if candidate.virtual > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage",
                  str(layers_per_stage(spec.config.model.num_layers, candidate.pipeline * candidate.virtual))]
    return [spec.command[0]] + flags


def predicted_iterations_per_second(spec: JobSpec, worker_type: str, speed: float) -> float:
    """Iterations/s of the job on one host's worth of its devices of ``worker_type`` (part 1's
    ``planner_steps_per_second`` for this model on that type); 0.0 where no layout fits."""
    cluster = _cluster((HostSlots("any", worker_type, spec.devices),), speed)
    try:
        return planner_steps_per_second(_profile(spec), {worker_type: cluster}, _request(spec))[worker_type]
    except ConfigError:
        return 0.0


def _without(flags: list[str], names: tuple) -> list[str]:
    """``flags`` minus every ``--name value`` and ``--name=value`` of ``names``."""
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        elif flag.split("=")[0] not in names:
            kept.append(flag)
    return kept
