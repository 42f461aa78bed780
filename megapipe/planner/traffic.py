"""What a layout sends between nodes per iteration: the bytes each kind of communication puts on
the inter-node links, from the rank order and the algorithm of each collective.

Ranks are laid out tensor-innermost (rank = t_i + t (c_i + c (d_i + d p_i)), node = rank //
gpus_per_node; ``layout/ranks.py``). Per iteration of m microbatches of b samples (each context
rank sending its s / c tokens' share of every activation):

* pipeline: every stage boundary carries the boundary tensor (b s h elements) forward and its
  gradient backward, per microbatch; with scatter/gather each of the t tensor ranks sends 1/t
  of it (and the receivers all-gather inside their tensor group), without it each sends all of
  it. A boundary counts when its two ends sit on different nodes.
* tied embedding: the first and the last stage sum the word embedding's gradient (V/t x h per
  tensor rank) with an all-reduce of two members, unless the schedule unties it.
* context parallelism: per context group and block, the key/value exchanges of ``context_costs.py``
  (a ring step's message on every ring link, collectives as rings, an all-to-all's 1/c of what a
  rank sends to each member on another node), forward and backward, once more with recomputation.
* data parallelism: per data-x-context group, the gradient reduction of every rank's parameters but
  its experts, whose gradients are reduced over their expert-data group instead (``layout/experts.py``)
  (``no_shard``: all-reduce; sharded: reduce-scatter, then an all-gather of the updated
  weights; ``optim_grads_params`` gathers the weights before each forward and backward of
  every microbatch instead, and not after the step).
* expert parallelism (e > 1): per MoE block and microbatch two all-to-alls forward (dispatch,
  combine) and two backward (two more with recomputation), in which every member of an expert
  group (as ``layout/experts.py`` folds a stage's t x c x d ranks) sends each other member 1/e of
  its b s k / c routed tokens (k per token, no dropping): the pairs whose ends are on different
  nodes count.
* tensor parallelism: the all-reduces of the layers (2 per block forward, 2 backward, 2 more
  with recomputation; 1 after the embedding and 1 into the head), the vocabulary-parallel
  cross entropy's three all-reduces of b s values, and the all-gather of scatter/gather; zero
  across nodes whenever t divides the node's size, as the tensor-innermost order keeps a
  tensor group inside a node.

Collectives run as rings in group-rank order, so a collective of n members puts its per-link
volume on each ring link (member i to i+1 and n-1 to 0) whose ends are on different nodes.
The per-link volumes are the algorithms' (``link_bytes``): an all-reduce moves 2 (n-1)/n of
the tensor over every link, an all-gather (n-1)/n of the gathered tensor, a reduce-scatter
(n-1)/n, except on gloo, whose reduce-scatter all-reduces the whole tensor and keeps a slice
(measured on the wire: ``benchmarks/bench_traffic.py``).

On the wire each TCP segment of at most ``MSS`` payload bytes carries ``FRAME_OVERHEAD`` bytes
of Ethernet, IP and TCP headers (``wire_bytes``); acknowledgements and the few bytes of the
per-iteration control collectives (loss, norms, exit flags) are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Sequence

from megapipe.layout.ranks import RankLayout
from megapipe.planner.context_costs import Exchange
from megapipe.layout.placement import Placement, rank_of_stage, stages_of_rank

BACKENDS = ("nccl", "gloo")
MTU = 1500  # bytes of an Ethernet frame's payload
FRAME_OVERHEAD = 14 + 20 + 32  # per TCP segment: Ethernet, IPv4, TCP with the timestamp option
MSS = MTU - 20 - 32  # TCP payload bytes per full segment


def link_bytes(collective: str, nbytes: float, members: int, backend: str = "nccl") -> float:
    """Bytes one ring link carries in ``collective`` of a tensor of ``nbytes`` (the gathered size for
    an all-gather, the input for a reduce-scatter) over ``members`` ranks."""
    if members <= 1:
        return 0.0
    share = (members - 1) / members * nbytes
    if collective == "all_reduce" or (collective == "reduce_scatter" and backend == "gloo"):
        return 2 * share
    if collective in ("reduce_scatter", "all_gather"):
        return share
    raise ValueError(f"unknown collective {collective!r}")


def crossing_links(ranks: Sequence[int], node_of: Callable[[int], int]) -> int:
    """Ring links (member i to i + 1, the last to the first) whose ends are on different nodes."""
    n = len(ranks)
    if n <= 1:
        return 0
    if n == 2:
        return 2 * (node_of(ranks[0]) != node_of(ranks[1]))  # a ring of two is both directions
    return sum(node_of(ranks[i]) != node_of(ranks[(i + 1) % n]) for i in range(n))


def wire_bytes(payload: float) -> float:
    """Ethernet frames for ``payload`` bytes of TCP stream: the payload plus one header per full segment."""
    return payload * (1 + FRAME_OVERHEAD / MSS)


@dataclass(frozen=True)
class Traffic:
    """Payload bytes per iteration crossing between nodes, by kind of communication."""

    pipeline: float
    embedding: float
    data: float
    tensor: float
    context: float = 0.0
    expert: float = 0.0

    @property
    def total(self) -> float:
        return self.pipeline + self.embedding + self.data + self.tensor + self.context + self.expert


@dataclass(frozen=True)
class TrafficInputs:
    """What the bytes depend on, per layout (``CostModel.traffic`` fills it from a profile)."""

    tensor: int
    pipeline: int
    data: int
    virtual: int
    microbatches: int  # m, per pipeline and iteration
    boundary_bytes: float  # one microbatch's boundary tensor on a context rank, whole (b s h / c x element bytes)
    rank_params: Sequence[float]  # parameters a rank of each pipeline rank holds (1/t of the split ones)
    tied_params: float  # the tied word embedding's parameters on a tensor rank (0 when untied)
    element_bytes: int  # of weights and activations
    grad_bytes: float  # per parameter in the gradient buffers
    sharding: str = "no_shard"
    scatter_gather: bool = True
    recompute: bool = False
    blocks_per_rank: Sequence[int] = ()  # transformer blocks on each pipeline rank (for tensor traffic)
    logit_values: float = 0.0  # b s: the cross entropy's reduced values per microbatch
    placement: Placement = Placement.LOOPED  # where the virtual stages live (``layout/placement.py``)
    context: int = 1
    context_exchanges: Sequence[Exchange] = ()  # per block and microbatch (``context_costs.exchanges``)
    expert: int = 1  # e, expert-parallel ranks
    expert_tensor: Optional[int] = None  # etp, the ranks that split each expert (None: t)
    moe_blocks_per_rank: Sequence[int] = ()  # MoE blocks on each pipeline rank
    rank_expert_params: Sequence[float] = ()  # the part of ``rank_params`` that is this rank's experts
    routed_token_bytes: float = 0.0  # one microbatch's tokens as dispatched: b s k h x element bytes


def cross_node_traffic(inputs: TrafficInputs, node_of: Callable[[int], int], backend: str = "nccl") -> Traffic:
    t, p, d, v, m, c = inputs.tensor, inputs.pipeline, inputs.data, inputs.virtual, inputs.microbatches, inputs.context

    layout = RankLayout(t, p, d, expert=inputs.expert, expert_tensor=inputs.expert_tensor, context=c)
    rank = layout.rank
    replicas = [(ti, di, ci) for ti in range(t) for di in range(d) for ci in range(c)]

    def crossing(a: int, b: int) -> bool:
        return node_of(a) != node_of(b)

    message = inputs.boundary_bytes / t if inputs.scatter_gather else inputs.boundary_bytes
    pipeline = 0.0
    stage_rank = [rank_of_stage(inputs.placement, p, stage) for stage in range(p * v)]
    for stage in range(p * v - 1):  # stage s sends to stage s + 1 (nothing where one rank holds both)
        ends = stage_rank[stage], stage_rank[stage + 1]
        pipeline += sum(2 * m * message for ti, di, ci in replicas
                        if crossing(rank(ti, di, ends[0], ci), rank(ti, di, ends[1], ci)))

    embedding = 0.0
    if inputs.tied_params and p * v > 1 and stage_rank[-1] != 0:  # under a V one rank holds both copies
        tied = inputs.tied_params * inputs.grad_bytes
        embedding = sum(crossing_links([rank(ti, di, 0, ci), rank(ti, di, p - 1, ci)], node_of)
                        * link_bytes("all_reduce", tied, 2, backend) for ti, di, ci in replicas)

    data = 0.0  # gradients are reduced over the data-x-context ranks, the experts' over their expert-data ranks
    data_crossings = _crossings_per_stage(layout, "data_context", node_of)
    expert_crossings = _crossings_per_stage(layout, "expert_data", node_of)
    for pi in range(p):
        experts = inputs.rank_expert_params[pi] if inputs.rank_expert_params else 0.0
        data += data_crossings[pi] * _reduction_link_bytes(inputs, inputs.rank_params[pi] - experts, d * c, backend)
        if experts:
            data += expert_crossings[pi] * _reduction_link_bytes(inputs, experts, layout.fold.expert_data, backend)

    tensor = 0.0
    if t > 1:
        activation = inputs.boundary_bytes
        tensor_crossings = _crossings_per_stage(layout, "tensor", node_of)
        for pi in range(p):
            blocks = inputs.blocks_per_rank[pi] if inputs.blocks_per_rank else 0
            head = pi == stage_rank[-1]
            reduces = (4 + 2 * inputs.recompute) * blocks + (pi == 0) + head
            per_link = m * reduces * link_bytes("all_reduce", activation, t, backend)
            if head:
                per_link += m * 3 * link_bytes("all_reduce", inputs.logit_values * 4, t, backend)
            # each chunk gathers its input (forward) and its output's gradient when they come from another rank
            received = sum(0 <= n < p * v and stage_rank[n] != pi
                           for s in stages_of_rank(inputs.placement, p, v, pi) for n in (s - 1, s + 1))
            if inputs.scatter_gather and p > 1:
                per_link += m * received * link_bytes("all_gather", activation, t, backend)
            tensor += tensor_crossings[pi] * per_link

    context = 0.0
    for group in layout.context_groups() if inputs.blocks_per_rank else ():
        blocks = inputs.blocks_per_rank[layout.coords(group[0]).pipeline]
        for exchange in inputs.context_exchanges:
            repeats = m * blocks * exchange.count * (1 + (inputs.recompute and not exchange.backward))
            context += repeats * exchange_crossing_bytes(exchange, group, node_of, backend)
    return Traffic(pipeline, embedding, data, tensor, context, _expert_traffic(inputs, layout, node_of))


def _reduction_link_bytes(inputs: TrafficInputs, params: float, members: int, backend: str) -> float:
    """Per ring link, what reducing the gradients of ``params`` parameters over ``members`` ranks moves per
    iteration, with the weight gathers the sharding level adds."""
    grads, weights = params * inputs.grad_bytes, params * inputs.element_bytes
    if inputs.sharding == "no_shard":
        return link_bytes("all_reduce", grads, members, backend)
    if inputs.sharding == "optim_grads_params":  # gathers before every pass instead of after the step
        return (link_bytes("reduce_scatter", grads, members, backend)
                + 2 * inputs.microbatches * link_bytes("all_gather", weights, members, backend))
    return link_bytes("reduce_scatter", grads, members, backend) + link_bytes("all_gather", weights, members, backend)


@lru_cache(maxsize=1024)
def _crossings_per_stage(layout: RankLayout, kind: str, node_of: Callable[[int], int]) -> tuple[int, ...]:
    """Per pipeline index, the ring links of the layout's ``kind`` groups (each inside one pipeline
    index) that cross nodes; cached, since a search asks for the same layouts many times."""
    counts = [0] * layout.pipeline
    for group in getattr(layout, f"{kind}_groups")():
        counts[layout.coords(group[0]).pipeline] += crossing_links(group, node_of)
    return tuple(counts)


def exchange_crossing_bytes(exchange: Exchange, group: Sequence[int], node_of: Callable[[int], int],
                            backend: str = "nccl") -> float:
    """Bytes one context-parallel exchange of ``group`` puts between nodes (once, not its repetitions)."""
    if exchange.kind == "all_to_all":
        share = exchange.nbytes / len(group)
        return sum(share for a in group for b in group if a != b and node_of(a) != node_of(b))
    if exchange.kind == "send":
        return crossing_links(list(group), node_of) * exchange.nbytes
    return crossing_links(list(group), node_of) * link_bytes(exchange.kind, exchange.nbytes, len(group), backend)


def _expert_traffic(inputs: TrafficInputs, layout: RankLayout, node_of: Callable[[int], int]) -> float:
    """Bytes the expert all-to-alls move between nodes (see the module docstring)."""
    e = inputs.expert
    if e <= 1:
        return 0.0
    per_peer = inputs.routed_token_bytes / e  # what one member sends one other member in one all-to-all
    total = 0.0
    for group in layout.expert_groups():
        blocks = inputs.moe_blocks_per_rank[layout.coords(group[0]).pipeline] if inputs.moe_blocks_per_rank else 0
        exchanges = inputs.microbatches * (4 + 2 * inputs.recompute) * blocks
        total += exchanges * per_peer * sum(node_of(a) != node_of(b) for a in group for b in group if a != b)
    return total
