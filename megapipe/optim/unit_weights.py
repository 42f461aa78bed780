"""A chunk's weights waited for, and under ZeRO-3 gathered and freed, a layer at a time around each pass.

The units of a chunk are its children, with a module list's members in place of the list: the embedding,
each transformer layer, the final norm. Their weights sit in buckets of their own under
``optim_grads_params`` (``grad_sync.plan_buckets``), each bucket with its own buffer.

* ZeRO-1/2 with ``--overlap-param-gather``: after the step every bucket's all-gather starts, in the order
  the forward first uses them. Each unit waits in its forward pre-hook for its own buckets only, so the
  first layer runs once its bucket has arrived while the later ones travel (Megatron-core waits per
  bucket in its modules' forward pre-hooks the same way).
* ZeRO-3 (``optim_grads_params``): a forward gathers the first unit's buckets, and each unit, as it
  starts, gathers the next one's (one layer ahead, as FSDP2 prefetches), waits for its own, and frees
  them once it has run, unless a later unit holds some of them too. The backward goes the other way: when
  the gradient of a unit's output arrives, the unit's buckets are waited for and the previous unit's
  start to gather; when the gradient of its input arrives, its backward is over and its buckets are freed.
  A forward that runs again inside the backward (recomputation) waits for what it needs, gathering it
  if it was freed. Only a pass that has the chunk to itself frees anything (an overlapped pair runs two).

A unit whose forward never runs reads nothing through it: its weights (the last stage's copy of the tied
embedding, which the stage reads as the output layer) are read by the chunk itself. So the first forward,
whose weights are whole from the start, only records which units run and in which order; from then on
the chunk's own pre-hook waits for the buckets of every weight no running unit holds, which are kept for
the whole pass. Layers compiled on their own (``models/compiled_layers.py``) compile their forward, not
their hooks, which run eagerly around it. The weights are the same, so the numbers are too.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch
from torch import nn

from megapipe.optim.grad_sync import GradSync, is_tied_embedding_copy
from megapipe.tensor_parallel.grad_accumulation import SUMMED_BY_AUTOGRAD


def units(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's children, with a module list's or dict's members in place of the container."""
    out = []
    for child in chunk.children():
        out.extend(child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child])
    return out


def unit_of_parameters(chunk: nn.Module) -> Callable[[torch.Tensor], int]:
    """A parameter's unit, as an index (-1: held by the chunk itself): where ``plan_buckets`` closes buckets."""
    index = {id(p): i for i, unit in enumerate(units(chunk)) for p in unit.parameters()}
    return lambda param: index.get(id(param), -1)


def _first_tensor(value) -> Optional[torch.Tensor]:
    """The tensor a unit passes on: its output itself, or the first element of a tuple of outputs."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _hook(tensor: Optional[torch.Tensor], call) -> None:
    """``call`` when the gradient of ``tensor`` arrives (nothing when none will)."""
    if tensor is not None and tensor.requires_grad and torch.is_grad_enabled():
        tensor.register_hook(lambda grad: call(grad) and None)


class UnitWeights:
    """The hooks of one chunk's units (module docstring); ``alone()`` says whether one pass has the chunk."""

    def __init__(self, sync: GradSync, chunk: nn.Module, alone: Callable[[], bool]):
        self.sync, self.chunk, self.alone = sync, chunk, alone
        self.frees = sync.level.shards_params
        self.units = [unit for unit in units(chunk) if sync.bucket_indices(unit.parameters())]
        self._ran: Optional[list[nn.Module]] = []  # the units the first forward ran, in order; None after
        self._position: dict[int, int] = {}  # id(unit) -> its place among the running units
        self._own: list[set[int]] = []  # per running unit: its buckets
        self._rest: set[int] = set()  # the buckets the chunk waits for itself, kept for the whole pass
        self._free_after_forward: list[set[int]] = []
        self._free_after_backward: list[set[int]] = []
        self._pass = threading.local()  # "forward" or "backward" while a pass of this thread runs
        chunk.register_forward_pre_hook(self._before_chunk)
        for unit in self.units:
            unit.register_forward_pre_hook(self._before_unit)
            unit.register_forward_hook(self._after_unit)

    @property
    def ready(self) -> bool:
        """Whether the first forward has been seen: from now on the hooks wait, not the pass's start."""
        return self._ran is None

    def begin(self, backward: bool) -> None:
        """A pass starts on this thread: under ZeRO-3 the first unit's buckets (in the pass's direction)
        and the chunk's own start to gather, and a backward waits for the chunk's own at once."""
        self._pass.kind = "backward" if backward else "forward"
        if self.frees and self.ready:
            self.sync.gather_buckets(self._rest | (self._own[-1 if backward else 0] if self._own else set()))
            if backward:
                self.sync.wait_for_buckets(self._rest)

    def end(self, backward: bool) -> None:
        """The pass of this thread is over; after the first forward, learn its units."""
        self._pass.kind = None
        if not backward and not self.ready:
            self._learn()

    def _learn(self) -> None:
        running = self._ran
        self._position = {id(unit): i for i, unit in enumerate(running)}
        self._own = [self.sync.bucket_indices(unit.parameters()) for unit in running]
        held = {id(p) for unit in running for p in unit.parameters()}
        # read by the chunk itself: weights of units that never ran, and the tied word embedding, which the
        # output layer reads after its unit ran (and whose gradient autograd sums over both uses)
        self._rest = self.sync.bucket_indices(p for p in self.chunk.parameters() if id(p) not in held or getattr(
            p, SUMMED_BY_AUTOGRAD, False) or is_tied_embedding_copy(p))
        after = [set().union(*self._own[i + 1:]) for i in range(len(running))]
        before = [set().union(*self._own[:i]) for i in range(len(running))]
        self._free_after_forward = [own - self._rest - later for own, later in zip(self._own, after)]
        self._free_after_backward = [own - self._rest - earlier for own, earlier in zip(self._own, before)]
        self._ran = None

    def _kind(self) -> Optional[str]:
        return getattr(self._pass, "kind", None)

    def _before_chunk(self, module, args) -> None:
        if self.ready:
            self.sync.gather_buckets(self._rest)
            self.sync.wait_for_buckets(self._rest)

    def _before_unit(self, module, args) -> None:
        forward = self._kind() == "forward"
        if self.frees and forward:  # this forward's backward, whichever mode it runs in (module docstring)
            _hook(_first_tensor(args), lambda grad: self._backward_done(module))
        if self._ran is not None:
            if forward and module not in self._ran:
                self._ran.append(module)
            return
        i = self._position.get(id(module))
        if i is None:
            return
        if self.frees and forward and i + 1 < len(self._own):
            self.sync.gather_buckets(self._own[i + 1])  # one layer ahead
        self.sync.gather_buckets(self._own[i])  # freed (recomputation, or a pass that shares the chunk)
        self.sync.wait_for_buckets(self._own[i])

    def _after_unit(self, module, args, output) -> None:
        if not self.frees or self._kind() != "forward":
            return
        _hook(_first_tensor(output), lambda grad: self._backward_starts(module))
        i = self._position.get(id(module))
        if i is not None and self.alone():
            self.sync.release_buckets(self._free_after_forward[i])

    def _backward_starts(self, module: nn.Module) -> None:
        """The gradient of ``module``'s output arrived: its backward is next, and the previous unit's after it."""
        i = self._position.get(id(module))
        if i is None:  # learnt after the forward ran
            return
        if i > 0:
            self.sync.gather_buckets(self._own[i - 1])
        self.sync.gather_buckets(self._own[i])
        self.sync.wait_for_buckets(self._own[i])

    def _backward_done(self, module: nn.Module) -> None:
        """The gradient of ``module``'s input arrived: its backward is over."""
        i = self._position.get(id(module))
        if i is not None and self.alone():
            self.sync.release_buckets(self._free_after_backward[i])
