"""How routed tokens reach their experts and come back (``--moe-token-dispatcher-type``).

Rank r of an expert group of e ranks holds the global experts [r E/e, (r+1) E/e). Both dispatchers
give the one-rank layer's results:

* ``alltoall`` (default): each rank permutes its own tokens into expert order (so into destination
  order), exchanges the per-expert counts, then the tokens, with one variable-split all-to-all, runs
  its experts on what it received (re-sorted from source order into expert order) and sends the
  outputs back by the reverse all-to-all; the routing weights are applied on the token's own rank.
  The splits are read on the host: one synchronisation per layer and microbatch; none with
  ``--moe-pad-expert-input-to-capacity``, where every expert gets exactly its capacity from every rank,
  so the splits and the re-sorting are fixed and no counts are exchanged; none either with
  ``--moe-dropless-device-dispatch``, where the counts are exchanged but stay on the device: each rank
  sends every expert rank a fixed buffer of the most rows it could send it (T min(k, E/e)), its rows
  first and zeros after, and the receiver sorts the rows into expert order by the counts, padding last.
  The grouped product leaves the padding rows out (its offsets end at the last real row); their
  outputs are zeroed, so nothing but the real rows reaches a gradient.
* ``allgather``: every rank gathers all ranks' tokens and routing, runs its experts on the tokens
  routed to them, and a reduce-scatter sums the weighted outputs back to the tokens' ranks (the
  number of routed pairs is read on the host).

The backward of each exchange is the reverse exchange. On one expert rank both are the permutation.
Each all-to-all marks itself as a DISPATCH or COMBINE segment (``parallel/comm_overlap.py``), so that
inside an overlapped pair (``--overlap-moe-expert-parallel-comm``) the other microbatch computes
while it is in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megapipe.models.moe.router import Routing
from megapipe.parallel import progress
from megapipe.parallel.comm_overlap import communicating
from megapipe.parallel.state import ParallelState
from megapipe.schedules.overlap import Segment
from megapipe.tensor_parallel import mappings


def assignments(routing_map: torch.Tensor, count: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, token) index pairs of the map's True entries [T, E], sorted by expert, then token, found by a
    stable sort. Their ``count``, when the caller does not know it, is read from the device (a synchronisation)."""
    if count is None:
        count = int(routing_map.sum())
    flat = routing_map.t().reshape(-1).to(torch.int8)
    positions = torch.sort(flat, descending=True, stable=True).indices[:count]
    tokens = routing_map.shape[0]
    return positions // tokens, positions % tokens


class _Exchange(torch.autograd.Function):
    """All-to-all of rows: ``send[i]`` rows go to rank i, ``recv[i]`` rows come from it; backward sends back.
    ``segment`` names the exchange in both passes (the backward of the combine is the backward's combine)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, segment: Segment):
        ctx.send, ctx.recv, ctx.group, ctx.segment = send, recv, group, segment
        return _all_to_all(x, send, recv, group, segment, backward=False)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.segment, backward=True), None, None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group, segment: Segment,
                backward: bool) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with communicating(segment, backward), progress.collective("the tokens' all_to_all", group, counted=False):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group, async_op=True).wait()
    return out


def _on_expert_ranks(permuted: torch.Tensor, counts: torch.Tensor, experts, ps: ParallelState,
                     padded: int | None, bound: int | None) -> torch.Tensor:
    """Rows sorted by global expert (``counts`` [E] each) through their experts, wherever those live.
    ``padded``: every expert has exactly that many rows of every rank (padded to its capacity), so the
    splits are known on the host and nothing is read from the device. ``bound``: no rank sends another
    more rows than this, so a buffer of that size carries them without reading the counts."""
    e = ps.ep_size
    if e == 1:
        return experts(permuted, counts if padded is None else padded)
    local = counts.numel() // e
    if padded is not None:
        return _on_expert_ranks_padded(permuted, experts, ps, local, padded)
    if bound is not None:
        return _on_expert_ranks_bounded(permuted, counts, experts, ps, local, bound)
    received = torch.empty_like(counts)  # [source rank, local expert]: rows each source sends each of my experts
    with communicating(Segment.DISPATCH, backward=False):  # the counts' exchange and the tokens' are one segment
        with progress.collective("the token counts' all_to_all", ps.ep_group, counted=False):
            dist.all_to_all_single(received, counts, group=ps.ep_group)
        send, recv = torch.stack([counts.view(e, local).sum(1), received.view(e, local).sum(1)]).tolist()
        x = _Exchange.apply(permuted, send, recv, ps.ep_group, Segment.DISPATCH)
    # the rows came source-major; the experts want them expert-major (stable: sources stay in order)
    expert_of_row = torch.repeat_interleave(torch.arange(e * local, device=counts.device) % local, received,
                                            output_size=sum(recv))
    order = torch.sort(expert_of_row, stable=True).indices
    out = experts(x[order], received.view(e, local).sum(0))
    back = torch.zeros_like(out).index_copy(0, order, out)
    return _Exchange.apply(back, recv, send, ps.ep_group, Segment.COMBINE)


def _on_expert_ranks_padded(permuted: torch.Tensor, experts, ps: ParallelState, local: int,
                            padded: int) -> torch.Tensor:
    """``_on_expert_ranks`` when each of the E experts has ``padded`` rows from every rank: each rank sends
    each other ``local x padded`` rows, and the rows a rank receives, source-major, are re-sorted by a fixed
    permutation into expert-major order."""
    e = ps.ep_size
    splits = [local * padded] * e
    x = _Exchange.apply(permuted, splits, splits, ps.ep_group, Segment.DISPATCH)
    expert_of_row = torch.arange(e * local * padded, device=permuted.device) // padded % local
    order = torch.sort(expert_of_row, stable=True).indices
    out = experts(x[order], e * padded)
    back = torch.zeros_like(out).index_copy(0, order, out)
    return _Exchange.apply(back, splits, splits, ps.ep_group, Segment.COMBINE)


def _on_expert_ranks_bounded(permuted: torch.Tensor, counts: torch.Tensor, experts, ps: ParallelState, local: int,
                             bound: int) -> torch.Tensor:
    """``_on_expert_ranks`` with every size on the device: rank d's rows go to places [d bound, (d + 1) bound)
    of a zero buffer, one fixed all-to-all carries it, and the rows received are sorted by (local expert,
    source), the padding after them."""
    e = ps.ep_size
    per_rank = counts.view(e, local).sum(1)  # rows this rank sends each expert rank
    ends = torch.cumsum(per_rank, 0)
    row = torch.arange(permuted.shape[0], device=permuted.device)
    rank_of_row = torch.searchsorted(ends, row, right=True)
    place = rank_of_row * bound + row - (ends - per_rank)[rank_of_row]
    buffer = permuted.new_zeros(e * bound, permuted.shape[1]).index_copy(0, place, permuted)
    received = torch.empty_like(counts)  # [source rank, local expert]
    splits = [bound] * e
    with communicating(Segment.DISPATCH, backward=False):
        with progress.collective("the token counts' all_to_all", ps.ep_group, counted=False):
            dist.all_to_all_single(received, counts, group=ps.ep_group)
        x = _Exchange.apply(buffer, splits, splits, ps.ep_group, Segment.DISPATCH)
    by_source = received.view(e, local)
    within = torch.arange(bound, device=counts.device).expand(e, bound).contiguous()
    expert_of_row = torch.searchsorted(torch.cumsum(by_source, 1), within, right=True).view(-1)  # local: padding
    order = torch.sort(expert_of_row, stable=True).indices
    out = experts(x[order], by_source.sum(0))
    out = torch.where((expert_of_row[order] < local).unsqueeze(1), out, 0.0)  # rows the product left unwritten
    back = torch.zeros_like(out).index_copy(0, order, out)
    return _Exchange.apply(back, splits, splits, ps.ep_group, Segment.COMBINE)[place]


def _combine(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, count: int | None, run,
             ps: ParallelState) -> torch.Tensor:
    """Every token's weighted sum of its experts' outputs [T, h], for the experts that ``routing_map`` lists;
    ``run(rows, counts)`` takes the rows sorted by expert to those experts' outputs (partial sums over the
    expert-tensor group, summed here at expert-tensor size t; below t the layer sums them with the other
    shares' over the whole tensor group, and its copy over that group sums the input gradients)."""
    expert_ids, token_ids = assignments(routing_map, count)
    whole_group = ps.etp_size == ps.tp_size
    if whole_group:
        tokens = mappings.copy_to_tensor_parallel_region(tokens, ps.etp_group)
    out = run(tokens[token_ids], routing_map.sum(dim=0))
    if whole_group:
        out = mappings.reduce_from_tensor_parallel_region(out, ps.etp_group)
    weights = probs[token_ids, expert_ids].unsqueeze(-1)
    return torch.zeros_like(tokens).index_add_(0, token_ids, (out * weights).to(tokens.dtype))


def alltoall(tokens: torch.Tensor, routing: Routing, count: int | None, experts, ps: ParallelState,
             padded: int | None = None, bound: int | None = None) -> torch.Tensor:
    """This rank's tokens [T, h] through their experts on every expert rank, weighted and summed: [T, h].
    ``padded``: the routing gives every expert exactly that many tokens (padded to its capacity);
    ``bound``: send fixed buffers of that many rows per expert rank, the counts staying on the device."""
    def run(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return _on_expert_ranks(rows, counts, experts, ps, padded, bound)

    return _combine(tokens, routing.routing_map, routing.probs, count, run, ps)


def allgather(tokens: torch.Tensor, routing: Routing, experts, ps: ParallelState) -> torch.Tensor:
    """The same result by gathering every expert rank's tokens and reduce-scattering the outputs."""
    group = ps.ep_group
    every_map = mappings.gather_from_sequence_parallel_region(routing.routing_map.to(torch.uint8), group, False)
    every_probs = mappings.gather_from_sequence_parallel_region(routing.probs, group)
    every_token = mappings.gather_from_sequence_parallel_region(tokens, group)
    local = routing.routing_map.shape[1] // ps.ep_size
    mine = slice(ps.ep_rank * local, (ps.ep_rank + 1) * local)
    routing_map = every_map[:, mine].bool()
    combined = _combine(every_token, routing_map, every_probs[:, mine], None, experts, ps)
    return mappings.reduce_scatter_to_sequence_parallel_region(combined, group)
