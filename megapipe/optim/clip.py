"""Global gradient norm over a model split across tensor and pipeline ranks, and clipping by it.

Every element of the full model's gradient must be counted exactly once. A rank therefore
counts its tensor-parallel shards, its replicated parameters only on tensor rank 0 (the other
tensor ranks hold identical copies), and never the last stage's copy of the tied embedding
(``shared_embedding``: the first stage already counts that gradient). The squared partial norms
are then summed over the model-parallel group (all t x p ranks of one replica); data-parallel
replicas hold identical gradients after the all-reduce and need no reduction, unless the
optimizer is sharded and each replica holds only its piece (summed over the data-x-context ranks,
over which shards are cut). Under expert parallelism each expert
rank holds other experts (``expert_parallel`` parameters): their squares are also summed over the
expert group, which a sharded optimizer's data-parallel sum already covers (the expert and
expert-data ranks of a stage are its data-parallel and context ranks).

Every gradient is read once for the norm (one multi-tensor pass; the groups above are sums of its
per-tensor results). Clipping costs no pass of its own under torch's fused optimizers, which divide
each gradient by ``clip_divisor`` as they read it; other optimizers get one multi-tensor multiply.
"""

from __future__ import annotations

import torch

from megapipe.parallel.collectives import all_reduce
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.utils import is_expert_parallel, is_tensor_parallel_duplicate

CLIP_EPSILON = 1e-6  # added to the norm before dividing, as Megatron does


def counts_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` contributes to the global gradient norm (an expert rank's experts,
    whole at expert-tensor size 1, are no tensor rank's copy of another's)."""
    if getattr(param, "shared_embedding", False):
        return False
    return is_expert_parallel(param) or not is_tensor_parallel_duplicate(param, tp_rank)


def local_squared_norm(params: list[torch.Tensor], ps: ParallelState, sharded: bool = False) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (``param.grad``), an fp32 scalar.

    Inf or NaN in any gradient makes it inf or NaN, including the copies the norm does not count
    (they add 0 x their norm, which is NaN only when they are not finite): without loss scaling
    this is the overflow check, and no rank can step on a copy that went bad while its counted
    twin did not. Unless ``sharded``, the experts' part is summed over the expert group here.
    """
    with_grad = [p for p in params if p.grad is not None]
    device = with_grad[0].device if with_grad else (params[0].device if params else None)
    norms = list(zip(torch._foreach_norm([p.grad.float() for p in with_grad]), with_grad)) if with_grad else []
    squared = _squares([(norm, p) for norm, p in norms if not is_expert_parallel(p)], ps, device)
    experts = _squares([(norm, p) for norm, p in norms if is_expert_parallel(p)], ps, device)
    if not sharded:
        all_reduce(experts, ps.ep_group, ps.ep_size)
        experts = experts * _first_share(ps)
    return squared + experts


def _first_share(ps: ParallelState) -> float:
    """1 on the tensor ranks whose summed experts' part counts, 0 on the others: at an expert-tensor size below
    t, every share of the tensor group (its ``etp`` ranks, the first share ranks 0 .. etp - 1) holds the same
    sums over its expert groups (times 0 still passes on inf and NaN)."""
    return 1.0 if ps.tp_rank < ps.etp_size else 0.0


def _squares(norms: list[tuple[torch.Tensor, torch.Tensor]], ps: ParallelState, device) -> torch.Tensor:
    """The squares of the counted gradients' norms (``(norm, param)`` pairs) summed, plus 0 x the others'."""
    squared = torch.zeros((), dtype=torch.float32, device=device)
    for counted in (True, False):
        group = [norm for norm, p in norms if counts_in_norm(p, ps.tp_rank) == counted]
        if group:
            part = torch.stack(group).square().sum()
            squared += part if counted else 0.0 * part
    return squared


def clip_grads_by_total_norm(params: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by ``max_norm / (total_norm + 1e-6)`` when that is below 1 (Megatron's rule).

    The coefficient stays on the device (times 1 exactly when there is nothing to clip), so
    clipping never waits for the norm to reach the host.
    """
    coefficient = (max_norm / (total_norm + CLIP_EPSILON)).clamp(max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coefficient.to(grads[0].dtype))


def clip_divisor(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """Megatron's clipping as a divisor, ``(total_norm + 1e-6) / max_norm`` and at least 1, for a fused
    optimizer to divide each gradient by as it reads it (its ``grad_scale``): no pass of its own. On the
    device, and exactly 1 when there is nothing to clip."""
    return ((total_norm + CLIP_EPSILON) / max_norm).clamp(min=1.0)


def count_zero_grads(params: list[torch.Tensor], ps: ParallelState, sharded: bool = False) -> torch.Tensor:
    """Number of exactly-zero gradient elements in the whole model, counted like the norm."""
    device = params[0].device if params else None
    zeros, expert_zeros = (torch.zeros((), dtype=torch.int64, device=device) for _ in range(2))
    for param in params:
        if param.grad is not None and counts_in_norm(param, ps.tp_rank):
            count = param.grad.numel() - torch.count_nonzero(param.grad)
            if is_expert_parallel(param):
                expert_zeros += count
            else:
                zeros += count
    if not sharded:
        all_reduce(expert_zeros, ps.ep_group, ps.ep_size)
        expert_zeros *= int(_first_share(ps))
    zeros += expert_zeros
    all_reduce(zeros, ps.mp_group, ps.tp_size * ps.pp_size)
    if sharded:
        all_reduce(zeros, ps.dp_cp_group, ps.dp_cp_size)
    return zeros

