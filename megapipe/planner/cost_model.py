"""THROUGHPUT and MEMORY of one parallel layout: seed 002's closed forms (section 3.3.3) extended to
tensor parallelism, interleaving and every schedule, with the communication volumes of section 4.3.

Per microbatch of b samples, a rank computes its stages' layers; a tensor-parallel rank at b
takes as long as the whole layer at b / t (same FLOPs, smaller GEMMs). Communication adds to a
rank's time (it is on the critical path):
  tensor parallelism: 2 all-reduces of b s h elements per block forward, 2 backward (2 more when
    recomputing), 1 after the embedding and 1 into the head: 8 b s h (t-1)/t per block in all;
  pipeline parallelism: each stage boundary carries b s h / t per tensor rank (scatter/gather)
    forward and the same backward. Sends are asynchronous and overlap compute, but a transfer
    moves only once its receive is posted (gloo's and NCCL's rendezvous), and the lowered lists
    post a receive just before the compute that consumes it: so a rank waits, per microbatch,
    for the transfer of each tensor it receives, |A| / bandwidth + latency, added to the forward
    that takes the activation and to the backward that takes the gradient (not, as in seed 002's
    THROUGHPUT(.), 2 |A| / bandwidth per neighbour on both). On gloo the wait is two transfers when
    the schedule alternates forwards and backwards: a receive's notice to the sender queues behind
    the tensor just sent the other way on the same connection (``exposed_transfers``; measured by
    ``benchmarks/bench_planner_network.py``). A boundary's bandwidth is that of one pipeline
    replica (its t tensor ranks send at once and share the node's uplink); the d replicas take
    turns, so the uplink bounds only the batch: m times what all of them send across the busiest
    link in one direction (full duplex). The schedule's closed form then treats these waits as
    part of each rank's forward and backward: exact for GPipe and for two stages under 1F1B, within
    a few percent of the simulator for longer 1F1B pipelines (``tests/test_planner_costs.py``);
  data parallelism: a ring all-reduce of each rank's gradients, 2 (d-1)/d |W| bytes, once per
    batch, after the flush for flushing schedules and overlapped with compute for 2BW and
    PipeDream (max(pipeline, all-reduce), THROUGHPUT(.)'s max(T_comp, T_comm / m)). A sharded
    optimizer (``Candidate.sharding``) reduce-scatters the gradients and all-gathers the updated
    weights instead ((d-1)/d of each); optim_grads_params all-gathers a chunk's weights before
    every forward and backward instead, 2 m (d-1)/d |W| per batch, on the critical path (the
    volumes are ``traffic.link_bytes``: gloo's reduce-scatter moves an all-reduce's bytes). With
    ``Training.overlap`` a flush hides the reduction behind the last microbatch's backward and
    the weight gather behind the rank's wait for its first input (none on rank 0); the tied
    word embedding is also summed between the first and the last stage (2BW and PipeDream
    untie it instead: the last stage holds its own output embedding of the same size).
  expert parallelism (MoE models, ``Candidate.expert`` e, expert-tensor size ``Candidate.etp``): per MoE block
    (``--moe-layer-freq`` says which; dense blocks have no exchange) two all-to-alls forward (dispatch,
    combine) and two backward (two more when recomputing), each sending b s k h element bytes x etp/t (at
    etp below t each of the t/etp shares of a tensor group dispatches its share of the tokens) x (e-1)/e
    over the link the expert group spans (at etp = t, e consecutive data-parallel replicas); the experts'
    compute per rank is the same at every etp (1/t of the tokens' expert products, split either way), and
    the partial outputs are summed over the tensor group as a dense MLP's. Each rank holds 1/(etp e) of the
    experts, whose gradients are reduced (and, at sharding levels, whose gradients, weights and optimizer
    state are sharded) over the t c d / (etp e) expert-data ranks.
    With ``--overlap-moe-expert-parallel-comm`` (``Candidate.overlap_moe_comm``) the batch is the simulator's
    replay of the schedule's overlapped lists (``schedule_costs.overlapped_time``): each forward/backward
    pair hides its all-to-alls behind the other pass's compute as ``simulate.overlapped_pair_time``
    charges it, and the lists' peak in-flight microbatches set the activations' memory.
  context parallelism (``Candidate.context`` c): a rank holds s / c tokens of every sample, so its
    compute is the layers' at b / (t c) and its activations and messages those of b / c samples;
    each block adds its key/value exchanges over the context group (``context_costs.py``), on the
    critical path like the tensor-parallel all-reduces (the ring's overlap with the blocks'
    attention is not modelled); gradients are reduced, and sharded, over the d x c ranks.
A collective or message pays the link of the slowest pair it spans (``Cluster.link``) with the
rank order tensor-innermost, then context, then data, then pipeline, so t shares a node first; a collective's
steps cost the link's ``reduce_latency``, which on busy CPUs exceeds a message's latency.
The optimizer step (seconds per parameter from the profile) follows the flush, or for 2BW and
PipeDream runs in each stage's stream of backwards. When the devices are processes sharing
fewer cores (``Cluster.shared_cores``), a batch also takes at least all their compute over the
cores: a rank idle in a bubble lends its core to the others.
MEMORY(.) per rank = weight versions x weights + (gradients + optimizer state) per parameter +
in-flight microbatches x stashed activations; a sharded optimizer keeps 1/d of the optimizer
state plus a 1/d shard of the reduced gradients and of the weights next to the full gradient
buffer, which backward fills (optim_grads frees it only between steps, so its peak is
optim's); optim_grads_params holds 1/d of the weights plus the one chunk gathered for a pass; with recomputation a microbatch keeps only the
input of every k-th block, plus one segment of k blocks while it is recomputed (seed 002 section
4.3.5: c checkpoints cost c A_input + (l / c) A_intermediate), with k chosen to use the least memory.
The seeds' 2BW forms 2|W|/p + |A_total|/p + p |A_input| (recompute) and 2|W|/p + p |A_total|/p
(no recompute) are the t = 1, d = 1, k = l special cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from megapipe.schedules.catalog import schedule_descriptor
from megapipe.layout.ranks import RankLayout
from megapipe.planner.cluster import Cluster, Link
from megapipe.planner.context_costs import Exchange, exchanges
from megapipe.planner.profile import LayerCosts, ModelProfile
from megapipe.planner.schedule_costs import (SEARCHED, Searched, bubble_fraction, flushes, in_flight, overlapped_time,
                                             pipeline_time, placement_of, searched, unties_embeddings, weight_versions)
from megapipe.planner.traffic import Traffic, TrafficInputs, cross_node_traffic, link_bytes
from megapipe.layout.placement import Placement, rank_of_stage, stages_of_rank
from megapipe.layout.stage_plan import equal_split


@dataclass(frozen=True)
class Candidate:
    """One point of the search: parallel degrees, micro-batch size, schedule, chunks, recomputation."""

    tensor: int
    pipeline: int
    data: int
    micro_batch_size: int
    schedule: str
    virtual: int = 1
    recompute: bool = False
    sharding: str = "no_shard"  # --data-parallel-sharding-strategy
    expert: int = 1  # --expert-model-parallel-size e: e x etp divides t x c x d
    context: int = 1  # --context-parallel-size c: each sequence over c ranks (context_costs.py)
    cp_comm_type: str = "p2p"
    overlap_moe_comm: bool = False  # --overlap-moe-expert-parallel-comm: pairs hide expert all-to-alls
    expert_tensor: Optional[int] = None  # --expert-tensor-parallel-size, a divisor of t below it (None: t)
    sequence_parallel: bool = False  # --sequence-parallel: the activations t replicates are split along s too

    @property
    def etp(self) -> int:
        """The expert-tensor size: how many ranks split each expert's ffn dimension."""
        return self.expert_tensor or self.tensor

    @property
    def expert_data(self) -> int:
        """The ranks that hold the same experts (``layout/experts.py``): t c d / (etp e)."""
        return self.tensor * self.context * self.data // (self.etp * self.expert)

    def describe(self) -> str:
        chunks = f", v={self.virtual}" if self.virtual > 1 else ""
        sharded = f", {self.sharding}" if self.sharding != "no_shard" else ""
        experts = f", e={self.expert}" if self.expert > 1 else ""
        experts += f", etp={self.expert_tensor}" if self.expert_tensor is not None else ""
        context = f", c={self.context} ({self.cp_comm_type})" if self.context > 1 else ""
        context += " with sequence parallelism" if self.sequence_parallel else ""
        return (f"t={self.tensor}{context}, p={self.pipeline}, d={self.data}{experts}, b={self.micro_batch_size}{chunks}, "
                f"{self.schedule}{' with recomputation' if self.recompute else ''}{sharded}"
                f"{' with overlapped expert all-to-alls' if self.overlap_moe_comm else ''}")


@dataclass(frozen=True)
class Training:
    global_batch_size: int
    grad_bytes_per_param: float = 4.0  # megapipe accumulates gradients in fp32 buffers
    optimizer_bytes_per_param: Optional[float] = None  # default: Adam's two fp32 moments, plus an fp32 master
    #                                                    copy when the weights are 16-bit
    overlap: bool = False  # --overlap-grad-reduce (and --overlap-param-gather when sharded)
    scatter_gather: bool = True  # off: --no-scatter-gather-tensors-in-pipeline, each tensor rank sends it all

    def optimizer_bytes(self, element_bytes: int) -> float:
        if self.optimizer_bytes_per_param is not None:
            return self.optimizer_bytes_per_param
        return 8.0 + (4.0 if element_bytes < 4 else 0.0)


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    microbatches: int  # per pipeline and batch: m = B / (d b)
    batch_time: float  # seconds
    samples_per_second: float
    memory: float  # bytes on the fullest device
    bubble: float  # idle over ideal time, equal ranks
    recompute_layers: Optional[int]  # blocks per recomputation segment (k), None without recomputation
    compute_time: float  # per batch on the slowest rank, and the communication it waits for:
    tensor_comm_time: float
    pipeline_comm_time: float
    data_comm_time: float
    optimizer_time: float  # the slowest rank's optimizer steps per batch
    flops_per_gpu: float  # model FLOP/s per device (eq. 4.2's count, recomputation included when used)
    traffic: Traffic  # payload bytes per batch crossing between nodes (``traffic.py``)
    rank_times: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())  # per rank: forward, backward seconds
    stage_times: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())  # the same per virtual stage
    expert_comm_time: float = 0.0  # per batch on the slowest rank: the MoE blocks' token all-to-alls it waits
    #                                for, less what --overlap-moe-expert-parallel-comm's pairs hide
    context_comm_time: float = 0.0  # per batch on the slowest rank: the key/value exchanges of context parallelism
    expert_comm_total: float = 0.0  # per batch on the slowest rank: the token all-to-alls, hidden or not


def collective_time(collective: str, nbytes: float, members: int, link: Link, backend: str = "nccl") -> float:
    """A ring collective over ``link``: its per-link volume (``traffic.link_bytes``: 2 (n-1)/n x bytes
    for an all-reduce, (n-1)/n for an all-gather or, except on gloo, a reduce-scatter) at the reduce
    bandwidth, plus a latency per ring step (2 (n-1) for an all-reduce, n-1 otherwise)."""
    if members <= 1 or nbytes == 0:
        return 0.0
    steps = (2 if collective == "all_reduce" else 1) * (members - 1)
    return link_bytes(collective, nbytes, members, backend) / link.reduce_bandwidth + steps * link.reduce_latency


def all_to_all_time(nbytes: float, members: int, link: Link) -> float:
    """One all-to-all of ``nbytes`` per rank over ``link``: the (n-1)/n that leaves the rank at the link's
    bandwidth, and a latency per peer."""
    if members <= 1 or nbytes == 0:
        return 0.0
    return nbytes * (members - 1) / members / link.bandwidth + (members - 1) * link.latency


def exposed_transfers(schedule: str, backend: str) -> int:
    """Transfer times a rank waits for each tensor it receives from a neighbour (module docstring): one,
    or two on gloo when the schedule alternates forwards and backwards, because a receive's notice to
    the sender queues behind the tensor just sent the other way on the same connection."""
    return 2 if backend == "gloo" and schedule_descriptor(schedule).alternates else 1


def exchange_time(exchange: Exchange, members: int, link: Link, backend: str = "nccl") -> float:
    """Seconds of one context-parallel exchange (``context_costs.py``) over ``link``, all its repetitions."""
    if exchange.kind == "send":
        one = _transfer(exchange.nbytes, link)
    elif exchange.kind == "all_to_all":
        one = all_to_all_time(exchange.nbytes, members, link)
    else:
        one = collective_time(exchange.kind, exchange.nbytes, members, link, backend)
    return exchange.count * one


def _boundary_pairs(layout: RankLayout, replicas, r: int) -> list[list[int]]:
    """The (sender, receiver) pairs of pipeline link r (rank r to r + 1, wrapping) in the given replicas."""
    p = layout.pipeline
    return [[layout.rank(ti, di, r, ci), layout.rank(ti, di, (r + 1) % p, ci)]
            for ti in range(layout.tensor) for ci in range(layout.context) for di in replicas]


def _slowness(link: Link) -> tuple:
    return (link.bandwidth, link.reduce_bandwidth, -link.latency)


def _boundary_index(placement: Placement, p: int, stage: int, neighbour: int) -> Optional[int]:
    """The pipeline link r (rank r to r + 1, wrapping) between the ranks of ``stage`` and ``neighbour``,
    or None when both are on one rank (the turn of a V)."""
    a, b = rank_of_stage(placement, p, stage), rank_of_stage(placement, p, neighbour)
    if a == b:
        return None
    return a if (a + 1) % p == b else b


def _boundary(links, placement: Placement, p: int, stage: int, neighbour: int) -> Optional[Link]:
    index = _boundary_index(placement, p, stage, neighbour)
    return None if index is None else links[index]


def _transfer(nbytes: float, link: Optional[Link]) -> float:
    """Seconds one message of ``nbytes`` takes over ``link`` (none: both ends on one rank)."""
    return 0.0 if link is None else nbytes / link.bandwidth + link.latency


def stage_layers(num_layers: int, num_stages: int, stage: int) -> list[int]:
    """Profile layer indices of virtual stage ``stage`` of an equal split (``profile_layers``)."""
    return profile_layers(equal_split(num_layers, num_stages).layer_ranges, stage)


def profile_layers(layer_ranges, stage: int) -> list[int]:
    """Profile layer indices of stage ``stage`` when stage s holds blocks ``layer_ranges[s]``: its blocks, the
    embedding (index 0) on the first stage, the head (one past the last block) on the last."""
    start, end = layer_ranges[stage]
    num_layers = layer_ranges[-1][1]
    return ([0] if stage == 0 else []) + list(range(1 + start, 1 + end)) + (
        [num_layers + 1] if stage == len(layer_ranges) - 1 else [])


def model_flops_per_sample(profile: ModelProfile, recompute: bool) -> float:
    """Model FLOPs per sample as the model's family counts them (``ModelShape.flops_per_sample``): for ffn = 4h and
    multi-head attention seed 002 eq. 4.2, (72 or 96, with recomputation) s l h^2 (1 + s / 6h) + 6 s h V."""
    return profile.shape.flops_per_sample(recompute)


class PlanCostModel:
    """Estimates for one profile on one cluster; caches what layouts share."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, training: Training):
        self.profile, self.cluster, self.training = profile, cluster, training
        self.element_bytes = profile.element_bytes
        self.optimizer_bytes = training.optimizer_bytes(profile.element_bytes)

    @lru_cache(maxsize=None)
    def costs(self, micro_batch_size: float) -> LayerCosts:
        return self.profile.costs(micro_batch_size)

    @lru_cache(maxsize=None)
    def links(self, t: int, p: int, d: int, c: int = 1) -> tuple[Link, Link, tuple[Link, ...], Link]:
        """Tensor-group, data-x-context-group (gradients), per-boundary pipeline (rank r to r+1, wrapping)
        and embedding-group links, with the ranks in Megatron's order (``layout/ranks.py``).

        A boundary's link is that of one pipeline replica: its t x c tensor and context ranks send at the
        same moment and share their node's uplink, while the d replicas are independent pipelines that
        take turns on it (``boundary_uplinks`` bounds what all of them send together)."""
        slowest, layout = self.cluster.group_link, RankLayout(t, p, d, context=c)
        boundaries = tuple(min((slowest(_boundary_pairs(layout, [di], r)) for di in range(d)), key=_slowness)
                           for r in range(p))
        embedding = slowest([[group[0], group[-1]] for group in layout.pipeline_groups()])
        return slowest(layout.tensor_groups()), slowest(layout.data_context_groups()), boundaries, embedding

    @lru_cache(maxsize=None)
    def context_link(self, t: int, p: int, d: int, c: int) -> Link:
        """The link of the context groups: c ranks t apart, in context-index order (a ring under p2p)."""
        return self.cluster.group_link(RankLayout(t, p, d, context=c).context_groups())

    @lru_cache(maxsize=None)
    def expert_links(self, t: int, p: int, d: int, e: int, c: int = 1, etp: Optional[int] = None) -> tuple[Link, Link]:
        """The links of the expert groups (e ranks etp apart within a stage's t x c x d, as
        ``megapipe.layout.experts`` folds them: at etp = t consecutive data-parallel or context ranks of one
        tensor index) and of the expert-data groups."""
        layout = RankLayout(t, p, d, expert=e, expert_tensor=etp, context=c)
        return self.cluster.group_link(layout.expert_groups()), self.cluster.group_link(layout.expert_data_groups())

    @lru_cache(maxsize=None)
    def boundary_uplinks(self, t: int, p: int, d: int, c: int = 1) -> tuple[Link, ...]:
        """Per boundary (rank r to r+1, wrapping), the link all t x c x d pairs across it share when they send at once."""
        layout = RankLayout(t, p, d, context=c)
        return tuple(self.cluster.group_link(_boundary_pairs(layout, range(d), r)) for r in range(p))

    def _rank_loads(self, candidate: Candidate) -> "_RankLoads":
        """Per pipeline rank and microbatch: seconds of compute and communication, parameters and stashes."""
        shape = self.profile.shape
        t, p, v, b, c = candidate.tensor, candidate.pipeline, candidate.virtual, candidate.micro_batch_size, candidate.context
        stages, n_layers = p * v, shape.num_layers
        placement = placement_of(candidate.schedule)
        # a context rank holds s / c tokens of each sample: the work and bytes of b / c whole samples
        timing, sizes = self.costs(b / (t * c)), self.costs(b / c)
        tensor_link, _, boundary_links, _ = self.links(t, p, candidate.data, c)
        speed = self.cluster.compute_speed
        backward = timing.recompute_backward if candidate.recompute else timing.backward
        activation = b * shape.seq_length / c * shape.hidden_size * self.element_bytes
        context = [0.0, 0.0]  # per block: seconds of the key/value exchanges forward, backward
        if c > 1:
            for exchange in exchanges(candidate.cp_comm_type, c, b * shape.seq_length / c, shape.hidden_size / t,
                                      self.element_bytes):
                context[exchange.backward] += exchange_time(exchange, c, self.context_link(t, p, candidate.data, c),
                                                            self.cluster.backend)
        if candidate.recompute:
            context[1] += context[0]
        allreduce = collective_time("all_reduce", activation, t, tensor_link, self.cluster.backend)
        # the stash each tensor rank holds: what the split products keep, 1/t of it; the rest (the norms'
        # inputs, the dropout masks) whole, or under sequence parallelism 1/t of it too (its sequence's share)
        replicated = sizes.stash_bytes - sizes.split_stash_bytes
        stash = replicated / (t if candidate.sequence_parallel else 1) + sizes.split_stash_bytes / t
        params = sizes.params - sizes.split_params + sizes.split_params / t
        loads = _RankLoads(p, stages, block_stash=float(stash[1]), block_input=float(sizes.output_bytes[1]))
        e = candidate.expert
        # per MoE block: one all-to-all; the experts' parameters held, and as the profile splits them (1/t)
        exchange, expert_params, experts_at_t = 0.0, 0.0, 0.0
        if e > 1:  # at e = 1 no exchange: each rank's tokens stay with its own copy of every expert
            exchange = all_to_all_time(self.routed_token_bytes(candidate),
                                       e, self.expert_links(t, p, candidate.data, e, c, candidate.expert_tensor)[0])
        if e > 1 or candidate.etp < t:  # experts held otherwise than the dense layers
            expert_params = shape.expert_params_per_block / candidate.etp / e
            experts_at_t = shape.expert_params_per_block / t
        message_split = t if self.training.scatter_gather else 1
        for s in range(stages):
            r, layers = rank_of_stage(placement, p, s), stage_layers(n_layers, stages, s)
            blocks = [l for l in layers if 1 <= l <= n_layers]
            ends = [l for l in layers if l not in blocks]  # embedding and head: never recomputed
            moe_blocks = len([l for l in blocks if shape.is_moe_layer(l - 1)])  # --moe-layer-freq's
            forward = timing.forward[layers].sum() / speed
            back = backward[layers].sum() / speed
            tp_forward = (2 * len(blocks) + (s == 0)) * allreduce
            tp_backward = ((4 if candidate.recompute else 2) * len(blocks) + (s == stages - 1)) * allreduce
            ep_forward = 2 * moe_blocks * exchange  # dispatch and combine; backward both again, and the
            ep_backward = (4 if candidate.recompute else 2) * moe_blocks * exchange  # recomputed forward's
            message = sizes.output_bytes[blocks[-1]] / message_split
            waits = exposed_transfers(candidate.schedule, self.cluster.backend)
            receive_forward, receive_backward = (
                waits * _transfer(message, _boundary(boundary_links, placement, p, s, neighbour))
                if 0 <= neighbour < stages else 0.0 for neighbour in (s - 1, s + 1))
            cp_forward, cp_backward = len(blocks) * context[0], len(blocks) * context[1]
            loads.stage_forward[s] = forward + tp_forward + ep_forward + cp_forward + receive_forward
            loads.stage_backward[s] = back + tp_backward + ep_backward + cp_backward + receive_backward
            loads.stage_expert[s], loads.stage_moe_layers[s] = ep_forward, moe_blocks
            loads.forward[r] += loads.stage_forward[s]
            loads.backward[r] += loads.stage_backward[s]
            loads.expert[r] += ep_forward + ep_backward
            loads.context[r] += cp_forward + cp_backward
            loads.compute[r] += forward + back
            loads.tensor[r] += tp_forward + tp_backward
            loads.pipe[r] += receive_forward + receive_backward
            link = _boundary_index(placement, p, s, s + 1) if s + 1 < stages else None
            if link is not None:  # per microbatch each direction of the link carries this boundary's tensor once
                loads.link_bytes[link] += message
                loads.link_messages[link] += 1
            loads.params[r] += params[layers].sum() + moe_blocks * (expert_params - experts_at_t)
            loads.expert_params[r] += moe_blocks * expert_params
            loads.stash[r] += stash[layers].sum()
            loads.unrecomputed_stash[r] += stash[ends].sum()
        if stages > 1:
            loads.params[rank_of_stage(placement, p, stages - 1)] += self.profile.output_weight_params / t  # the
            # head's own output embedding (under the V, a copy on the first rank summed there)
        return loads

    def _data_parallel_times(self, candidate: Candidate, loads: "_RankLoads", m: int) -> np.ndarray:
        """Per rank, the data-parallel time the batch waits for: the gradient reduction (all-reduce, or
        reduce-scatter and weight all-gather when sharded, minus what overlap hides), optim_grads_params'
        gathers before every pass, and the tied embedding's sum."""
        t, p, d, c = candidate.tensor, candidate.pipeline, candidate.data, candidate.context
        _, data_link, _, embedding_link = self.links(t, p, d, c)
        grad_bytes, params = self.training.grad_bytes_per_param, loads.params
        overlap = self.training.overlap and flushes(candidate.schedule)
        backend = self.cluster.backend
        # the dense parameters over the data-x-context group, the experts' over their expert-data group
        groups = [(params - loads.expert_params, d * c, data_link)]
        if candidate.expert > 1 or candidate.etp < t:  # one after the other
            groups.append((loads.expert_params, candidate.expert_data,
                           self.expert_links(t, p, d, candidate.expert, c, candidate.expert_tensor)[1]))

        def over_groups(collective: str, element_bytes: float) -> np.ndarray:
            return np.array([sum(collective_time(collective, counts[r] * element_bytes, members, link, backend)
                                 for counts, members, link in groups) for r in range(p)])

        if candidate.sharding == "no_shard":
            reduce, gather = over_groups("all_reduce", grad_bytes), np.zeros(p)
        else:
            reduce, gather = over_groups("reduce_scatter", grad_bytes), over_groups("all_gather", self.element_bytes)
        passes = 0.0
        if candidate.sharding == "optim_grads_params":  # gathers before every F and B, none after the step
            passes, gather = 2 * m * gather, np.zeros(p)
        if overlap:
            reduce = np.maximum(reduce - loads.backward, 0.0)  # behind the last microbatch's backward
            gather = np.maximum(gather - np.arange(p) * loads.forward, 0.0)  # behind the wait for the first input
        times = reduce + gather + passes
        tied = self.profile.output_weight_params
        last = rank_of_stage(placement_of(candidate.schedule), p, p * candidate.virtual - 1)
        if p * candidate.virtual > 1 and tied and not unties_embeddings(candidate.schedule, p) and last != 0:
            for r in {0, p - 1}:
                times[r] += collective_time("all_reduce", tied / t * grad_bytes, 2, embedding_link, backend)
        return times

    def _memory(self, candidate: Candidate, loads: "_RankLoads", m: int,
                search: Optional[Searched] = None) -> tuple[float, Optional[int]]:
        """Peak bytes over ranks, and the blocks per recomputation segment that minimise it."""
        p, v = candidate.pipeline, candidate.virtual
        weights = np.array([self._state_bytes(candidate, loads.params[r], r, loads.expert_params[r]) for r in range(p)])
        counts = np.array([float(search.in_flight[r] if search else in_flight(candidate.schedule, p, m, v, r))
                           for r in range(p)])
        if not candidate.recompute:
            return float((weights + counts * loads.stash).max()), None
        per_chunk = self.profile.shape.num_layers // (p * v)

        def peak(k: int) -> float:  # every k-th block input kept per chunk, one segment of k blocks live
            kept = loads.unrecomputed_stash + v * (per_chunk // k) * loads.block_input
            return float((weights + counts * kept).max() + k * loads.block_stash)

        best = min((k for k in range(1, per_chunk + 1) if per_chunk % k == 0), key=peak)
        return peak(best), best

    def _state_bytes(self, candidate: Candidate, params: float, rank: int, expert_params: float = 0.0) -> float:
        """Weights (all versions), gradients and optimizer state of ``params`` parameters at the candidate's sharding;
        ``expert_params`` of them (this rank's 1/e of the experts) are sharded over the d / e expert-data ranks."""
        d, grads = candidate.data * candidate.context, self.training.grad_bytes_per_param  # sharded over d x c
        versions = weight_versions(candidate.schedule, candidate.pipeline, rank)
        if candidate.sharding == "no_shard":
            return params * (self.element_bytes * versions + grads + self.optimizer_bytes)
        shard = (params - expert_params) / d + expert_params / candidate.expert_data
        weights = self.element_bytes * (versions * params + shard)
        if candidate.sharding == "optim_grads_params":
            weights = self.element_bytes * (shard + params / candidate.virtual)  # one chunk gathered for its pass
        return weights + grads * (params + shard) + self.optimizer_bytes * shard

    def estimate(self, candidate: Candidate) -> Estimate:
        t, p, d, v = candidate.tensor, candidate.pipeline, candidate.data, candidate.virtual
        batch = self.training.global_batch_size
        m = batch // (d * candidate.micro_batch_size)
        loads = self._rank_loads(candidate)
        steps = loads.params * self.profile.optimizer_step_s_per_param / self.cluster.compute_speed  # per batch
        data = float(self._data_parallel_times(candidate, loads, m).max())
        search = self._simulated(candidate, loads, m)
        if search is not None:
            batch_time = search.batch_time + data + float(steps.max())
        elif flushes(candidate.schedule):  # all-reduce and step after the flush
            pipe = pipeline_time(candidate.schedule, loads.forward, loads.backward, m, v)
            batch_time = pipe + data + float(steps.max())
        else:  # each stage steps in its stream of backwards (2BW once per batch, PipeDream per microbatch, m = 1)
            pipe = pipeline_time(candidate.schedule, loads.forward, loads.backward + steps / m, m, v)
            batch_time = max(pipe, data)
        batch_time = max(batch_time, m * self._busiest_link(candidate, loads))
        if self.cluster.shared_cores is not None:  # processes on fewer cores: idle ranks lend theirs
            work = t * candidate.context * d * float(m * loads.compute.sum() + steps.sum())
            batch_time = max(batch_time, work / self.cluster.shared_cores)
        memory, recompute_layers = self._memory(candidate, loads, m, search)
        slowest = int(np.argmax(loads.forward + loads.backward))
        exposed = search.exposed_expert_comm[slowest] if candidate.overlap_moe_comm else m * float(loads.expert[slowest])
        samples = batch / batch_time
        flops = model_flops_per_sample(self.profile, candidate.recompute) * samples / (t * candidate.context * p * d)
        return Estimate(candidate, m, batch_time, samples, memory, float(bubble_fraction(candidate.schedule, p, m, v)),
                        recompute_layers, m * float(loads.compute[slowest]), m * float(loads.tensor[slowest]),
                        m * float(loads.pipe[slowest]), data, float(steps.max()), flops, self.traffic(candidate, loads),
                        (tuple(map(float, loads.forward)), tuple(map(float, loads.backward))),
                        (tuple(map(float, loads.stage_forward)), tuple(map(float, loads.stage_backward))),
                        exposed, m * float(loads.context[slowest]), m * float(loads.expert[slowest]))

    def _simulated(self, candidate: Candidate, loads: "_RankLoads", m: int) -> Optional[Searched]:
        """What the simulator predicts for a candidate without closed forms: the searched schedule's, or the
        overlapped pairs' (whose passes, never recomputed, each run half a rank's all-to-alls); else None."""
        if candidate.schedule == SEARCHED:
            return searched(loads.forward, loads.backward, m, candidate.virtual)
        if candidate.overlap_moe_comm:
            return overlapped_time(candidate.schedule, candidate.pipeline, loads.stage_forward, loads.stage_backward,
                                   loads.stage_expert, loads.stage_moe_layers, m, candidate.virtual)
        return None

    def routed_token_bytes(self, candidate: Candidate) -> float:
        """What one rank dispatches in one all-to-all, b s k h element bytes on a context rank: at etp below t
        each of the t / etp shares of the tensor group dispatches its t / etp-th of the tokens."""
        shape = self.profile.shape
        tokens = candidate.micro_batch_size * shape.seq_length / candidate.context * candidate.etp / candidate.tensor
        return tokens * shape.moe_router_topk * shape.hidden_size * self.element_bytes

    def _busiest_link(self, candidate: Candidate, loads: "_RankLoads") -> float:
        """Seconds per microbatch that the busiest pipeline link takes, in one direction, to carry what all
        data-parallel replicas and tensor ranks send across it (full duplex: the other direction is as busy)."""
        uplinks = self.boundary_uplinks(candidate.tensor, candidate.pipeline, candidate.data, candidate.context)
        return max((loads.link_bytes[r] / link.bandwidth + loads.link_messages[r] * link.latency
                    for r, link in enumerate(uplinks)), default=0.0)

    def traffic(self, candidate: Candidate, loads: Optional["_RankLoads"] = None) -> Traffic:
        """Payload bytes per batch that ``candidate`` sends between the cluster's nodes."""
        loads = loads or self._rank_loads(candidate)
        shape, t, p, v = self.profile.shape, candidate.tensor, candidate.pipeline, candidate.virtual
        b = candidate.micro_batch_size
        placement = placement_of(candidate.schedule)
        tied = 0.0 if unties_embeddings(candidate.schedule, p) else self.profile.output_weight_params / t
        blocks = [sum(len([l for l in stage_layers(shape.num_layers, p * v, s) if 1 <= l <= shape.num_layers])
                      for s in stages_of_rank(placement, p, v, r)) for r in range(p)]
        moe_blocks = [sum(loads.stage_moe_layers[s] for s in stages_of_rank(placement, p, v, r)) for r in range(p)]
        c, tokens = candidate.context, b * shape.seq_length / candidate.context  # per context rank
        inputs = TrafficInputs(t, p, candidate.data, v, self.training.global_batch_size // (candidate.data * b),
                               tokens * shape.hidden_size * self.element_bytes, list(loads.params),
                               tied, self.element_bytes, self.training.grad_bytes_per_param, candidate.sharding,
                               self.training.scatter_gather, candidate.recompute, blocks_per_rank=blocks,
                               logit_values=tokens, placement=placement, context=c,
                               context_exchanges=exchanges(candidate.cp_comm_type, c, tokens, shape.hidden_size / t,
                                                           self.element_bytes),
                               expert=candidate.expert, expert_tensor=candidate.expert_tensor, moe_blocks_per_rank=moe_blocks,
                               rank_expert_params=list(loads.expert_params), routed_token_bytes=self.routed_token_bytes(candidate))
        return cross_node_traffic(inputs, self.cluster.node_of, self.cluster.backend)


class _RankLoads:
    """Sums over a rank's chunks: seconds per microbatch and bytes, one array entry per pipeline rank."""

    def __init__(self, p: int, stages: int, block_stash: float, block_input: float):
        self.forward, self.backward, self.compute = np.zeros(p), np.zeros(p), np.zeros(p)
        # per virtual stage: forward and backward seconds, one pass's expert all-to-alls, MoE blocks
        self.stage_forward, self.stage_backward, self.stage_expert = np.zeros(stages), np.zeros(stages), np.zeros(stages)
        self.stage_moe_layers = [0] * stages
        self.tensor, self.pipe, self.expert, self.context = np.zeros(p), np.zeros(p), np.zeros(p), np.zeros(p)
        self.params, self.stash, self.unrecomputed_stash = np.zeros(p), np.zeros(p), np.zeros(p)
        self.expert_params = np.zeros(p)  # the part of ``params`` split by expert parallelism (0 at e = 1)
        self.link_bytes, self.link_messages = np.zeros(p), np.zeros(p)  # per link r (rank r to r+1, wrapping)
        #                                      and direction, what one pair sends per microbatch
        self.block_stash, self.block_input = block_stash, block_input
