"""The planner: seed 002's Algorithm 1 over data-parallel size d and pipeline depth p, extended so that
SEARCH also chooses the tensor size t = N / (d p), the micro-batch size b, recomputation, the
schedule, the number of chunks v and, for an MoE model, the expert-parallel size e, scored by
``cost_model`` (THROUGHPUT and MEMORY).

Every layout that uses all N devices, divides the model (heads and width by t, layers by p v)
and the global batch B (by d b, so m = B / (d b) microbatches per pipeline) and suits its
schedule is estimated, at every e that divides the experts and every expert-tensor size etp dividing t
with etp x e dividing t x c x d (Megatron-core's rule, ``megapipe.layout.experts``); dense models keep
e = 1.
At e > 1 without recomputation a layout is estimated with ``--overlap-moe-expert-parallel-comm`` off and,
where its schedule has pairs the flag accepts (``schedule_costs.overlapped``), on. Those that fit in
device memory are ranked by predicted throughput.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional, Sequence

from megapipe.errors import ConfigError
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import PlanCostModel, Estimate, Candidate, Training
from megapipe.planner.profile import ModelProfile, ModelShape
from megapipe.config.sharding import SHARDING_STRATEGIES
from megapipe.schedules.catalog import default_schedule
from megapipe.planner.schedule_costs import (SCHEDULES, SEARCHED, SEARCHED_LAYOUTS, flushes, microbatch_problem,
                                             overlapped, planned_chunks)
from megapipe.planner.units import human_bytes


@dataclass(frozen=True)
class PlanRequest:
    global_batch_size: int
    schedules: Sequence[str] = SCHEDULES
    micro_batch_sizes: Optional[Sequence[int]] = None  # default: every divisor of B / d up to the maximum
    max_micro_batch_size: int = 64
    recompute: Sequence[bool] = (False, True)
    shardings: Sequence[str] = SHARDING_STRATEGIES  # --data-parallel-sharding-strategy levels tried when d > 1
    max_virtual: int = 8  # most chunks per rank tried for the schedules that take several
    training: Optional[Training] = None  # default: Training(global_batch_size)
    context_sizes: Sequence[int] = (1,)  # --context-parallel-size values tried (those the sequence and world allow)
    cp_comm_type: str = "p2p"  # of every layout with c > 1 (context_costs.PLANNED_COMM_TYPES)

    def costs_training(self) -> Training:
        return self.training or Training(self.global_batch_size)


@dataclass
class PlanResult:
    best: Estimate  # Algorithm 1's choice
    ranked: list[Estimate]  # layouts that fit, fastest first
    best_by_data_pipeline: dict  # (d, p) -> SEARCH's choice, Algorithm 1's inner step
    evaluated: int


def algorithm1(devices: int, search: Callable, throughput: Callable, memory: Callable, capacity: float):
    """Seed 002 Algorithm 1: for every (d, p) with d p <= N, SEARCH picks the rest of the layout;
    keep the highest-throughput choice whose MEMORY fits. Returns (d, p, choice) or None."""
    best, best_throughput = None, 0.0
    for d in range(1, devices + 1):
        for p in range(1, devices // d + 1):
            choice = search(d, p)
            if choice is None:
                continue
            value = throughput(d, p, choice)
            if memory(d, p, choice) > capacity:
                continue
            if value > best_throughput:
                best, best_throughput = (d, p, choice), value
    return best


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def expert_sizes(shape: ModelShape, tensor: int, data: int) -> list[tuple[int, Optional[int]]]:
    """The (e, etp) a stage of t x ``data`` ranks (data-parallel x context replicas) allows, as the parallel
    config and ``megapipe.layout.experts`` do: e divides the experts, etp divides t, etp x e divides t x c x d
    (below t at e = 1 each tensor share holds whole experts for its share of the tokens). etp = t is written None (Megatron's default, no flag)."""
    if not shape.is_moe:
        return [(1, None)]
    return [(e, None if etp == tensor else etp) for e in _divisors(shape.num_experts) for etp in _divisors(tensor)
            if (tensor * data) % (etp * e) == 0]


def model_splits(shape: ModelShape, devices: int, context: int = 1) -> Iterator[tuple[int, int, int]]:
    """(t, p, d) with t c p d = devices, t dividing heads, width and MLP widths (the experts' too, as
    training's checks ask), p dividing the layers."""
    if devices % context:
        return
    for t in _divisors(devices // context):
        widths = (shape.num_attention_heads, shape.hidden_size, shape.ffn_hidden_size, shape.expert_ffn_hidden_size)
        if any(width % t for width in widths):
            continue
        for p in _divisors(devices // (context * t)):
            if shape.num_layers % p == 0:
                yield t, p, devices // (context * t * p)


def context_allowed(shape: ModelShape, tensor: int, context: int, comm_type: str) -> bool:
    """Whether c splits the sequence into 2c chunks and, for a2a, each tensor rank's heads."""
    if context == 1:
        return True
    return shape.seq_length % (2 * context) == 0 and not (
        comm_type == "a2a" and (shape.num_attention_heads // tensor) % context)


def enumerate_layouts(shape: ModelShape, devices: int, request: PlanRequest) -> Iterator[Candidate]:
    batch = request.global_batch_size
    splits = [(t, c, p, d) for c in request.context_sizes for t, p, d in model_splits(shape, devices, c)
              if context_allowed(shape, t, c, request.cp_comm_type)]
    for t, c, p, d in splits:
        if batch % d:
            continue
        sizes = request.micro_batch_sizes or [b for b in _divisors(batch // d) if b <= request.max_micro_batch_size]
        for b in sizes:
            if (batch // d) % b:
                continue
            m = batch // (d * b)
            for schedule in request.schedules:
                if schedule == SEARCHED:
                    continue  # searched for the fastest layouts only, in ``plan``
                if p == 1 and schedule != default_schedule(1):
                    continue  # without a pipeline every schedule is gradient accumulation
                chunks = [v for v in planned_chunks(schedule, request.max_virtual) if shape.num_layers % (p * v) == 0]
                for v in chunks:
                    if microbatch_problem(schedule, p, m, v) is None:
                        for recompute in request.recompute:
                            for sharding in _shardings(request, c * d, schedule):
                                for e, etp in expert_sizes(shape, t, c * d):
                                    candidate = Candidate(t, p, d, b, schedule, v, recompute, sharding, e, c,
                                                    request.cp_comm_type, expert_tensor=etp)
                                    yield candidate
                                    if e > 1 and not recompute and overlapped(schedule, p, m, v) is not None:
                                        yield replace(candidate, overlap_moe_comm=True)


def searched_layouts(estimates: list[Estimate], cluster: Cluster) -> list[Candidate]:
    """The searched schedule (``auto``) on the pipelined one-chunk layouts of the ``SEARCHED_LAYOUTS``
    fastest fitting estimates: one search per candidate costs about a second, too much for all of them,
    and it is never slower than ZB-H1 on the same candidate (a seed of the search within its memory)."""
    layouts = []
    for e in sorted(estimates, key=lambda e: -e.samples_per_second):
        candidate = replace(e.candidate, schedule=SEARCHED, overlap_moe_comm=False)
        if (e.memory <= cluster.usable_memory and candidate.pipeline > 1 and candidate.virtual == 1
                and microbatch_problem(SEARCHED, candidate.pipeline, e.microbatches, 1) is None and candidate not in layouts):
            layouts.append(candidate)
        if len(layouts) == SEARCHED_LAYOUTS:
            break
    return layouts


def _shardings(request: PlanRequest, d: int, schedule: str) -> list[str]:
    """Sharding levels worth estimating over ``d`` ranks (data-parallel x context): none over one; no
    optim_grads_params for 2BW and PipeDream."""
    if d == 1:
        return ["no_shard"]
    return [s for s in request.shardings if not (s == "optim_grads_params" and not flushes(schedule))]


def _no_layout_error(shape: ModelShape, devices: int, request: PlanRequest) -> ConfigError:
    batch = request.global_batch_size
    data_sizes = sorted({d for _, _, d in model_splits(shape, devices)})
    if not data_sizes:
        return ConfigError(f"this model cannot be split over {devices} devices: no tensor size divides its "
                           f"{shape.num_attention_heads} heads and no pipeline depth its {shape.num_layers} layers "
                           "while using every device; change the number of devices.")
    if all(batch % d for d in data_sizes):
        return ConfigError(f"--global-batch-size {batch} is not divisible by any data-parallel size this model allows "
                           f"on {devices} devices ({', '.join(map(str, data_sizes))}); use a multiple of "
                           f"{data_sizes[0]}.")
    return ConfigError(f"no layout with schedules {', '.join(request.schedules)} runs --global-batch-size {batch} on "
                       f"{devices} devices (each needs enough microbatches per pipeline); raise the batch size or "
                       "allow gpipe.")


def smallest_first(e: Estimate) -> tuple[float, float, str]:
    """Order of the layouts a memory error may name: least memory, then fastest, then by name (deterministic)."""
    return e.memory, -e.samples_per_second, e.candidate.describe()


def _memory_error(smallest: Estimate, cluster: Cluster) -> ConfigError:
    return ConfigError(f"no configuration fits in {human_bytes(cluster.usable_memory)} per device: the smallest "
                       f"needs {human_bytes(smallest.memory)} at {smallest.candidate.describe()}; add devices or "
                       "memory, or lower the micro-batch size.")


def plan(profile: ModelProfile, cluster: Cluster, request: PlanRequest) -> PlanResult:
    """Rank every fitting layout of ``profile``'s model on ``cluster`` for ``request``'s global batch."""
    if request.global_batch_size < 1:
        raise ConfigError(f"--global-batch-size {request.global_batch_size} must be at least 1.")
    unknown = [s for s in request.schedules if s not in SCHEDULES]
    if unknown:
        raise ConfigError(f"schedule {unknown[0]} is unknown; choose from {', '.join(SCHEDULES)}.")
    model = PlanCostModel(profile, cluster, request.costs_training())
    estimates = [model.estimate(layout) for layout in enumerate_layouts(profile.shape, cluster.num_gpus, request)]
    if not estimates:
        raise _no_layout_error(profile.shape, cluster.num_gpus, request)
    if SEARCHED in request.schedules:
        estimates += [model.estimate(layout) for layout in searched_layouts(estimates, cluster)]
    fitting = [e for e in estimates if e.memory <= cluster.usable_memory]
    if not fitting:
        raise _memory_error(min(estimates, key=smallest_first), cluster)

    def order(e: Estimate) -> tuple[float, float]:  # fastest first; of equally fast ones (a sharding level
        return -e.samples_per_second, e.memory       # that costs no time, say) the smallest

    best_by_data_pipeline: dict = {}
    for e in fitting:
        key = (e.candidate.data, e.candidate.pipeline)
        if key not in best_by_data_pipeline or order(e) < order(best_by_data_pipeline[key]):
            best_by_data_pipeline[key] = e
    ranked = sorted(fitting, key=order)
    _, _, best = algorithm1(cluster.num_gpus, lambda d, p: best_by_data_pipeline.get((d, p)),
                            lambda d, p, e: e.samples_per_second, lambda d, p, e: e.memory, cluster.usable_memory)
    return PlanResult(best, ranked, best_by_data_pipeline, len(estimates))
