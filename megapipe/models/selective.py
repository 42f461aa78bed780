"""Selective recomputation: a layer keeps what its matrix products and attention produce and recomputes
the cheap rest in the backward pass (``--recompute-granularity selective``).

Inside ``selective_recomputation`` (a layer's forward while training) the outputs of the norms
(LayerNorm/RMSNorm, the qk-norms), of RoPE and of the MLP's GeLU/SwiGLU (``recomputed``), and the dropout
masks of the dropout-adds (``recomputed_masks``), are not kept for the backward pass. Autograd still saves
them, through saved-tensor hooks, but as a recipe: the function, the tensors it read (or the recipes of
those) and, for dropout, the random states it drew from. The backward pass runs the recipe when a gradient
first needs the tensor and gets the same bits: the functions are deterministic, and dropout draws again
from the restored streams (the CPU and device generators and the tensor-parallel tracker's, as
``recompute.checkpoint`` restores them). A mask does not depend on the values it drops, so its recipe keeps
only the shapes of the dropout-add's operands (and runs the dropout-add again on placeholders of them: one
wasted elementwise pass under the eager and compiled kernels; Triton's keeps no mask, only a seed).

What a recipe reads the layer keeps anyway (a norm's input, which the norm's own backward needs; the
products' outputs, which the activations' and attention's backward need), so recipes cost no memory, and
matrix products, attention and collectives never run twice. Checkpointing the attention core instead (the
earlier meaning of ``selective``) frees nothing once flash attention keeps no [s, s] tensor.
``planner/analytic.py`` counts what stays. Under sequence parallelism a column-parallel linear keeps its
all-gathered input, which is not a norm's output, so there the norms' outputs stay.

A recipe reads the weights the forward ran on (detached aliases of them), so PipeDream's and 2BW's stashed
versions and ZeRO-3's re-gathered weights are the ones it recomputes with; the zero-bubble schedules' BI runs
recipes like any backward. Every other saved tensor goes to the saved-tensor hooks that were active before
(a memory profiler's), so accounting sees what really stays. Under saved-tensor hooks autograd hands a saved
parameter back as a new tensor, without the attributes set on it, so the linears also keep the weight itself
on their context for the owner of its main gradient (``tensor_parallel/split_backward.py``). Under
``torch.compile`` the functions just run: the compiler's partitioner chooses what to recompute there.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Callable, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef

from megapipe.parallel.random import capture_rng, restore_rng
from megapipe.parallel.state import ParallelState

_REGION: contextvars.ContextVar[Optional["_Region"]] = contextvars.ContextVar("selective_recomputation",
                                                                               default=None)


def _outer_hooks():
    """The saved-tensor hooks active outside the region (None if none), to pass the kept tensors on to."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def _geometry(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.stride(), tensor.storage_offset()


def _storage(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def _as_saved(base: torch.Tensor, registered: tuple, saved: tuple) -> torch.Tensor:
    """The view ``saved`` of the registered tensor (geometry ``registered``), taken of its recomputed ``base``."""
    if (tuple(base.shape), base.stride()) != registered[:2]:
        raise RuntimeError(f"selective recomputation recomputed a tensor of shape {tuple(base.shape)} and strides "
                           f"{base.stride()} where the forward made {registered[0]} and {registered[1]}.")
    if saved == registered:
        return base
    shape, stride, offset = saved
    return base.as_strided(shape, stride, base.storage_offset() + offset - registered[2])


class _Kept:
    """A tensor a recipe reads that the layer keeps anyway; an activation must be unchanged when it is read."""

    def __init__(self, tensor: torch.Tensor):
        self.value, self.requires_grad = tensor.detach(), tensor.requires_grad  # shares the version counter
        self.version = None if tensor.is_leaf else tensor._version

    def get(self) -> torch.Tensor:
        if self.version is not None and self.value._version != self.version:
            raise RuntimeError("a tensor that selective recomputation recomputes from was modified in place after "
                               "the forward pass; use --recompute-granularity full, or no recomputation, instead.")
        return self.value


class _Produced:
    """A tensor a recipe reads that is itself recomputed (by ``recipe``)."""

    requires_grad = True

    def __init__(self, recipe: "_Recipe", registered: tuple, saved: tuple):
        self.recipe, self.registered, self.saved = recipe, registered, saved

    def get(self) -> torch.Tensor:
        return _as_saved(self.recipe.output(), self.registered, self.saved)


class _Shape:
    """An operand whose values a dropout mask does not depend on: only its layout is kept."""

    def __init__(self, tensor: torch.Tensor):
        self.layout = (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)
        self.requires_grad = tensor.requires_grad

    def get(self) -> torch.Tensor:
        shape, stride, dtype, device = self.layout
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)


class _Recipe:
    """``function(*args)`` again, on the arguments and random states of its first run."""

    def __init__(self, function: Callable, args: list, rng: Optional[tuple] = None):
        self.function, self.args, self.rng = function, args, rng
        self._output: Optional[weakref.ref] = None
        self._saved: list[weakref.ref] = []

    def _inputs(self, grad: bool) -> list:
        """The arguments; with ``grad``, tensors are fresh leaves that require gradients where the originals did,
        so the function saves for its backward what it saved the first time."""
        if not grad:
            return [a.get() if isinstance(a, (_Kept, _Produced, _Shape)) else a for a in self.args]
        return [a.get().detach().requires_grad_(a.requires_grad) if isinstance(a, (_Kept, _Produced, _Shape)) else a
                for a in self.args]

    @contextlib.contextmanager
    def _random_states(self):
        if self.rng is None:
            yield
            return
        states, ps, device = self.rng
        now = capture_rng(ps.rng_tracker, device)
        restore_rng(states, ps.rng_tracker, device)
        try:
            yield
        finally:
            restore_rng(now, ps.rng_tracker, device)

    def output(self) -> torch.Tensor:
        """The function's output, recomputed (or still held by whoever asked last)."""
        out = None if self._output is None else self._output()
        if out is None:
            with torch.no_grad(), self._random_states():
                out = self.function(*self._inputs(grad=False))
            self._output = weakref.ref(out)
        return out

    def saved(self, index: int) -> torch.Tensor:
        """The ``index``-th tensor the function saves for its backward, from running it again with gradients."""
        held = [ref() for ref in self._saved]
        if index >= len(held) or held[index] is None:
            held = []

            def record(tensor):
                held.append(tensor)
                return tensor
            with torch.enable_grad(), self._random_states(), saved_tensors_hooks(record, lambda tensor: tensor):
                self.function(*self._inputs(grad=True))
            self._saved = [weakref.ref(tensor) for tensor in held]
        return held[index]


class _Packed:
    """What autograd holds instead of a recomputed tensor: the recipe, and which of its tensors (the output,
    seen through the view autograd saved, or the ``index``-th tensor the function saved)."""

    def __init__(self, recipe: _Recipe, index: Optional[int], registered: tuple = (), saved: tuple = ()):
        self.recipe, self.index, self.registered, self.saved = recipe, index, registered, saved

    def unpack(self) -> torch.Tensor:
        if self.index is not None:
            return self.recipe.saved(self.index)
        return _as_saved(self.recipe.output(), self.registered, self.saved)


class _Passed:
    """A kept tensor, as the outer saved-tensor hooks packed it."""

    def __init__(self, packed):
        self.packed = packed


class _Call:
    """A dropout-add running now: what it saves of x's size that is none of its operands is a mask."""

    def __init__(self, recipe: _Recipe, operands: list[torch.Tensor], mask_size: int):
        self.recipe, self.mask_size, self.saves = recipe, mask_size, 0
        self.operands = {_storage(t) for t in operands}

    def pack(self, tensor: torch.Tensor) -> Optional[_Packed]:
        self.saves += 1
        if tensor.numel() == self.mask_size and _storage(tensor) not in self.operands:
            return _Packed(self.recipe, self.saves - 1)
        return None


class _Region:
    """The recipes of one layer's forward, found by the storage of the tensors they produce."""

    def __init__(self):
        self.outputs: dict[StorageWeakRef, tuple[_Recipe, tuple]] = {}
        self.call: Optional[_Call] = None
        self.outer = _outer_hooks()

    def _registered(self, tensor: torch.Tensor) -> Optional[tuple[_Recipe, tuple]]:
        key = _storage(tensor)
        entry = self.outputs.get(key)
        if entry is not None and key.expired():
            del self.outputs[key]
            return None
        return entry

    def argument(self, value):
        """How a recipe holds ``value``: as it is, kept, or through the recipe that produced it."""
        if not isinstance(value, torch.Tensor):
            return value
        entry = self._registered(value)
        return _Kept(value) if entry is None else _Produced(entry[0], entry[1], _geometry(value))

    def register(self, out: torch.Tensor, recipe: _Recipe, inputs: list) -> None:
        storage = _storage(out)
        if all(storage != _storage(t) for t in inputs if isinstance(t, torch.Tensor)):  # not a view of an input
            self.outputs[storage] = (recipe, _geometry(out))

    def pack(self, tensor: torch.Tensor):
        packed = self.call.pack(tensor) if self.call is not None else None
        if packed is not None:
            return packed
        entry = self._registered(tensor)
        if entry is not None:
            return _Packed(entry[0], None, entry[1], _geometry(tensor))
        return _Passed(self.outer[0](tensor)) if self.outer is not None else tensor

    def unpack(self, packed):
        if isinstance(packed, _Packed):
            return packed.unpack()
        if isinstance(packed, _Passed):
            return self.outer[1](packed.packed)
        return packed


def _region() -> Optional["_Region"]:
    """The active region; none in code torch.compile traces, which cannot read a context variable and whose
    partitioner chooses what to recompute itself."""
    return None if torch.compiler.is_compiling() else _REGION.get()


@contextlib.contextmanager
def selective_recomputation(active: bool = True):
    """Within it (when ``active``), ``recomputed`` and ``recomputed_masks`` save recipes instead of tensors;
    nested uses share the outermost region."""
    if not active or torch.compiler.is_compiling() or _REGION.get() is not None:
        yield
        return
    region = _Region()
    token = _REGION.set(region)
    try:
        with saved_tensors_hooks(region.pack, region.unpack):
            yield
    finally:
        _REGION.reset(token)


def _module_function(module: nn.Module) -> tuple[Callable, tuple[torch.Tensor, ...]]:
    """``module`` as a function of its input and of the parameters it holds now (whichever version they are)."""
    named = list(module.named_parameters())
    names = [name for name, _ in named]

    def run(x, *weights):
        return torch.func.functional_call(module, dict(zip(names, weights)), (x,))
    return run, tuple(param for _, param in named)


def recomputed(function: Callable, *args) -> torch.Tensor:
    """``function(*args)`` (a module or a deterministic function; one tensor out), whose output the backward
    pass recomputes instead of keeping, inside a selective-recomputation region; plain ``function(*args)``
    elsewhere."""
    out = function(*args)
    region = _region()
    if region is not None:
        if isinstance(function, nn.Module):
            function, params = _module_function(function)
            args = args + params
        region.register(out, _Recipe(function, [region.argument(a) for a in args]), args)
    return out


def recomputed_masks(function: Callable, ps: ParallelState, x: torch.Tensor, *args) -> torch.Tensor:
    """``function(x, *args)``, a dropout-add: inside a region, the dropout masks it keeps (tensors of x's size
    it creates) are drawn again in the backward pass from the random states of this call."""
    region = _region()
    if region is None:
        return function(x, *args)
    operands = [a for a in (x, *args) if isinstance(a, torch.Tensor)]
    layouts = [_Shape(a) if isinstance(a, torch.Tensor) and not a.is_leaf else region.argument(a) for a in (x, *args)]
    region.call = _Call(_Recipe(function, layouts, (capture_rng(ps.rng_tracker, x.device), ps, x.device)),
                        operands, x.numel())
    try:
        return function(x, *args)
    finally:
        region.call = None
