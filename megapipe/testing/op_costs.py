"""FLOPs, bytes moved, kernels and allocations of every operator a step runs, counted on the fake device.

``OpCosts`` is a dispatch mode for ``fake_accelerator``: no kernel runs, but each aten operator is
seen with its inputs and outputs, and becomes one ``OpCost``:

- FLOPs from ``torch.utils.flop_counter``'s formulas (matrix products, attention), in-place
  products (``addmm_``, ``baddbmm_``) by the formula of their out-of-place twin;
- bytes: each input read once and each output written once, a tensor counting the distinct
  elements it addresses (a broadcast bias is read once; an embedding lookup reads the rows it
  returns, not the whole table); an argument the operator only overwrites (``copy_``'s and
  ``out=``'s destination, ``zero_``, random fills, the gradients a fused optimizer takes) is not
  read. Views and metadata operators move nothing and launch nothing; allocating an empty
  tensor launches nothing either;
- allocations: the fresh tensors it returns, and their bytes.

``one_kernel(fn, category)`` makes whatever ``fn`` runs count as one kernel: the FLOPs of its
operators, the bytes it reads from tensors made before it (each view once, saved tensors included),
the bytes of the tensors it returns or writes into, and as allocations only the tensors it
returns. A fused kernel that falls back to a chain of eager operators on the fake device (a
Triton kernel needs a GPU) thus counts as the kernel it is on the GPU: its intermediates never
reach memory there. A fused kernel written as a custom operator needs nothing: it is one operator.

Each record carries the phase its caller names (``phase``) and a category for the step's
breakdown: the optimizer step, matrix products, attention, normalisation, cross-entropy (any
operator called from a ``*cross_entropy*`` module), the additions of low-precision weight
gradients into fp32 main gradients, copies and casts, and the elementwise rest.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from typing import Callable, Iterator, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

CATEGORIES = ("matmul", "attention", "norm", "elementwise", "cross-entropy", "main-grad adds", "copies",
              "optimizer")
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm, aten.addmm_, aten.baddbmm_}
IN_PLACE_TWINS = {aten.addmm_: aten.addmm, aten.baddbmm_: aten.baddbmm}  # same FLOPs as their twins
ATTENTION = {packet for packet in flop_registry if "attention" in str(packet)}
NORMS = {aten.native_layer_norm, aten.native_layer_norm_backward, aten._fused_rms_norm,
         aten._fused_rms_norm_backward, aten.rms_norm}
COPIES = {aten.copy_, aten._to_copy, aten.clone, aten._foreach_copy_}
# operators whose written arguments are not read first
OVERWRITES = {aten.copy_, aten.zero_, aten.fill_, aten.bernoulli_, aten.uniform_, aten.normal_, aten.random_,
              aten.exponential_, aten._foreach_copy_, aten._foreach_zero_}
# arguments a fused optimizer's schema marks as written that its kernel only reads (no gradient scaling here)
READ_ONLY = {aten._fused_adamw_: {"grads"}, aten._fused_adam_: {"grads"}, aten._fused_sgd_: {"grads"}}
METADATA = {aten._unsafe_view, aten.lift_fresh}  # new tensors on old storage: no kernel, nothing moved
ALLOCATES_ONLY = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
GATHERS = {aten.embedding: 0}  # the argument read only where the output says (a table's looked-up rows)
LOW_PRECISION = (torch.bfloat16, torch.float16)


class OpCost(NamedTuple):
    op: str
    category: str
    phase: str
    flops: int
    bytes: int
    kernels: int
    allocations: int
    allocated: int  # bytes
    fp8: bool  # a product of FP8 inputs (timed at the device's FP8 peak)


def footprint(tensor: torch.Tensor) -> int:
    """Bytes of the distinct elements ``tensor`` addresses (a broadcast dimension, stride 0, counts once)."""
    if tensor.numel() == 0:
        return 0
    return math.prod(n for n, step in zip(tensor.shape, tensor.stride()) if step != 0) * tensor.element_size()


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _key(tensor: torch.Tensor) -> int:
    return id(tensor.untyped_storage())


class _Region:
    """What one kernel made of several operators has counted so far."""

    def __init__(self):
        self.flops, self.fp8 = 0, False
        self.reads: dict[tuple, int] = {}  # view of a tensor made before the kernel -> its bytes
        self.writes: dict[tuple, int] = {}
        self.made: dict[int, object] = {}  # storages made inside (held, so that their ids stay theirs)

    def outside(self, tensors: list[torch.Tensor]) -> dict[tuple, int]:
        """Bytes of each distinct view in ``tensors`` of a storage made before the kernel."""
        return {_view(t): footprint(t) for t in tensors if _key(t) not in self.made}


def _view(tensor: torch.Tensor) -> tuple:
    return _key(tensor), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


class OpCosts(TorchDispatchMode):
    """Records an ``OpCost`` per operator in ``self.ops`` (enter it inside ``fake_accelerator``)."""

    def __init__(self):
        super().__init__()
        self.ops: list[OpCost] = []
        self._phase = ""
        self._region: _Region | None = None
        self._counting = False

    def __enter__(self):
        self._counting = True
        return super().__enter__()

    def __exit__(self, *exc):
        self._counting = False
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Operators run inside are recorded under ``name`` ("optimizer" makes their category "optimizer")."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def one_kernel(self, fn: Callable, category: str, name: str) -> Callable:
        """``fn`` counted as one kernel named ``name`` (see the module docstring)."""

        @functools.wraps(fn)
        def kernel(*args, **kwargs):
            if self._region is not None or not self._counting:  # inside a kernel already, or not counting
                return fn(*args, **kwargs)
            region = self._region = _Region()
            try:
                out = fn(*args, **kwargs)
            finally:
                self._region = None
            fresh = [t for t in _tensors(out) if _key(t) in region.made]
            region.writes.update({_view(t): footprint(t) for t in fresh})
            moved = sum(region.reads.values()) + sum(region.writes.values())
            self._record(name, category, region.flops, moved, len(fresh), sum(map(footprint, fresh)), region.fp8)
            return out

        return kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not _launches(func, out):
            return out
        packet = func.overloadpacket
        flops = _flops(packet, args, kwargs, out)
        fp8 = packet is aten._scaled_mm and _tensors(args)[0].element_size() == 1
        reads, writes, fresh = self._traffic(func, args, kwargs, out)
        if self._region is not None:
            region = self._region
            region.flops += flops
            region.fp8 |= fp8
            region.reads.update(region.outside(reads))
            region.writes.update(region.outside(writes))
            region.made.update({_key(t): t.untyped_storage() for t in fresh})
            return out
        moved = sum(map(footprint, reads)) + sum(map(footprint, writes + fresh))
        if packet in GATHERS:
            moved += footprint(_tensors(out)[0]) - footprint(args[GATHERS[packet]])
        if packet in ALLOCATES_ONLY:
            moved = 0
        self._record(str(packet).removeprefix("aten."), self._category(packet, args), flops, moved, len(fresh),
                     sum(map(footprint, fresh)), fp8)
        return out

    @staticmethod
    def _traffic(func, args, kwargs, out) -> tuple[list, list, list]:
        """(tensors read, arguments written, fresh tensors returned) of one operator."""
        packet = func.overloadpacket
        reads, writes = [], []
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        for argument in func._schema.arguments:
            tensors = _tensors(named.get(argument.name))
            written = (argument.alias_info is not None and argument.alias_info.is_write
                       and argument.name not in READ_ONLY.get(packet, ()))
            if written:
                writes += tensors
            if not written or (packet not in OVERWRITES and argument.name != "out"):
                reads += tensors
        aliased = {_key(t) for t in writes}
        fresh = [t for t in _tensors(out) if _key(t) not in aliased]
        return reads, writes, fresh

    @staticmethod
    def _category(packet, args) -> str:
        if packet in MATMULS:
            return "matmul"
        if packet in ATTENTION:
            return "attention"
        if packet in NORMS:
            return "norm"
        if _called_from("cross_entropy"):
            return "cross-entropy"
        if packet is aten.add_ and isinstance(args[1], torch.Tensor) and args[0].dtype == torch.float32 \
                and args[1].dtype in LOW_PRECISION:
            return "main-grad adds"
        return "copies" if packet in COPIES else "elementwise"

    def _record(self, name: str, category: str, flops: int, moved: int, allocations: int, allocated: int,
                fp8: bool) -> None:
        kernels = int(flops > 0 or moved > 0)
        category = "optimizer" if self._phase == "optimizer" else category
        self.ops.append(OpCost(name, category, self._phase, flops, moved, kernels, allocations, allocated, fp8))


def _launches(func, out) -> bool:
    """Whether ``func`` runs a kernel: not a view, metadata or host value; it returns or writes a tensor."""
    if func.is_view or func.overloadpacket in METADATA:
        return False
    written = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
    return bool(_tensors(out)) or written


def _flops(packet, args, kwargs, out) -> int:
    """``torch.utils.flop_counter``'s count for the operator (0 where it has no formula)."""
    formula = flop_registry.get(IN_PLACE_TWINS.get(packet, packet))
    if formula is None:
        return 0
    if packet in MATMULS:  # their formulas take the operands only (an ``out_dtype`` would land on ``out_shape``)
        return int(formula(*[a for a in args if isinstance(a, torch.Tensor)], out_val=out))
    return int(formula(*args, **kwargs, out_val=out))


def _called_from(part: str) -> bool:
    """Whether a Python frame of a file whose name contains ``part`` is on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if part in frame.f_code.co_filename.rsplit("/", 1)[-1]:
            return True
        frame = frame.f_back
    return False
