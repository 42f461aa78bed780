"""Collective matmul: sequence parallelism's forward all-gather and reduce-scatter as rounds of messages
around the ring of tensor ranks, each round's transfer behind a part of the product.

With sequence parallelism a column-parallel product needs every rank's rows of its input (an all-gather
before it) and a row-parallel product's partial output is summed and split along the sequence (a
reduce-scatter after it); run as collectives, both wait with nothing to compute. Split by rows into the
t ranks' blocks, the product needs one block at a time (Wang et al.'s decomposition, the one torch's
asynchronous tensor parallelism and Megatron-LM's ring-exchange overlap run):

* ``gathered_product``: each round sends the block here to the next rank and receives the previous
  rank's, while the block here is multiplied into its owner's rows of the output;
* ``scattered_product``: round k multiplies the rows of block ``(r - k - 1) mod t``, adds the running
  sum that arrived for it from the previous rank and sends it on; the last round's block is this rank's.

With ``--async-tensor-parallel`` (CUDA) both run as torch's symmetric-memory operators instead
(``fused_all_gather_matmul``, ``fused_matmul_reduce_scatter``: torchtitan's asynchronous tensor
parallelism), in which each GPU reads the other GPUs' blocks from their memory as the product needs them.

Every output row is the product of the same input row as after a gather; the sums of the
reduce-scatter add the same partial products, in the ring's order: at t = 2 that is a + b on one rank and
b + a on the other, the same bits as the collective; at larger t the order may differ from the
collective's by rounding. ``split_backward.scattered_linear`` is a row-parallel product with its
reduce-scatter so fused.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megapipe.errors import ConfigError
from megapipe.parallel.collectives import group_size
from megapipe.parallel.progress import collective


_symmetric_groups: Optional[set] = None  # with --async-tensor-parallel: the groups symmetric memory is enabled for


def use_symmetric_memory(on: bool, device: torch.device) -> None:
    """Whether the collective matmuls run through torch's symmetric memory (``--async-tensor-parallel``),
    chosen once per run; refused in one sentence where ``device`` or this build cannot."""
    global _symmetric_groups
    if not on:
        _symmetric_groups = None
        return
    problem = symmetric_memory_problem(device)
    if problem is not None:
        raise ConfigError(f"--async-tensor-parallel needs torch's symmetric memory on CUDA GPUs, but {problem}; "
                          "drop the flag: sequence parallelism's collective matmuls then run as point-to-point "
                          "rings.")
    _symmetric_groups = set()


def symmetric_memory_problem(device: torch.device) -> Optional[str]:
    """Why ``device`` cannot run the symmetric-memory operators, or None when it can."""
    if device.type != "cuda":
        return f"this run computes on the {device.type}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers the operators)
    except ImportError as error:
        return f"torch {torch.__version__} has no symmetric memory ({error})"
    if not hasattr(torch.ops.symm_mem, "fused_matmul_reduce_scatter"):
        return f"torch {torch.__version__} has no symm_mem.fused_matmul_reduce_scatter"
    return None


def _symmetric_name(group) -> Optional[str]:
    """The name of ``group`` with symmetric memory enabled for it, or None when the rings run."""
    if _symmetric_groups is None:
        return None
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    if group.group_name not in _symmetric_groups:
        enable_symm_mem_for_group(group.group_name)
        _symmetric_groups.add(group.group_name)
    return group.group_name


def _pass_on(block: torch.Tensor, group, rank: int, size: int, name: str):
    """Send ``block`` to the next rank of the ring and receive the previous rank's: (what arrives, a wait)."""
    arriving = torch.empty_like(block)
    following, preceding = (dist.get_global_rank(group, (rank + step) % size) for step in (1, -1))
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, block, following, group),
                                    dist.P2POp(dist.irecv, arriving, preceding, group)])

    def wait() -> torch.Tensor:
        with collective(name, group, counted=False):  # a message wait, shown as the collective it replaces
            for work in works:
                work.wait()
        return arriving
    return arriving, wait


def _product(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """``F.linear(rows, weight, bias)`` into ``out`` (the same kernel F.linear runs on 2-d rows)."""
    if bias is None:
        torch.mm(rows, weight.t(), out=out)
    else:
        torch.addmm(bias, rows, weight.t(), out=out)


def gathered_product(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group) -> torch.Tensor:
    """``F.linear`` of every rank's ``rows`` stacked in rank order (the all-gather's result), computed while
    the blocks travel around the ring (module docstring)."""
    name = _symmetric_name(group)
    if name is not None:
        _, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(rows.contiguous(), [weight.t()], 0, name,
                                                                return_A=False)
        return out if bias is None else out.add_(bias)
    rank, size, n = dist.get_rank(group), group_size(group), rows.shape[0]
    out = rows.new_empty((n * size, weight.shape[0]))
    here = rows.contiguous()
    for k in range(size):
        arriving, wait = _pass_on(here, group, rank, size, "all_gather") if k + 1 < size else (None, None)
        owner = (rank - k) % size
        _product(here, weight, bias, out[owner * n:(owner + 1) * n])
        if wait is not None:
            here = wait()
    return out


def scattered_product(rows: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """This rank's block of ``F.linear(rows, weight)`` summed over the ranks (the reduce-scatter's result),
    each running sum travelling to the next rank while the next block's product runs (module docstring)."""
    name = _symmetric_name(group)
    if name is not None:
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(rows, weight.t(), "sum", 0, name)
    rank, size = dist.get_rank(group), group_size(group)
    if rows.shape[0] % size:
        raise ValueError(f"sequence length {rows.shape[0]} is not divisible by the tensor-parallel size {size}")
    n = rows.shape[0] // size
    wait = None
    for k in range(size):
        block = (rank - k - 1) % size
        total = rows.new_empty((n, weight.shape[0]))
        _product(rows[block * n:(block + 1) * n], weight, None, total)
        if wait is not None:
            total += wait()
        if k + 1 < size:
            _, wait = _pass_on(total, group, rank, size, "reduce_scatter")
    return total
