"""Per-bucket weight waits in the forward (``--overlap-param-gather`` with a sharded optimizer, ZeRO-1/2).

After the step every bucket's all-gather starts, in the order the forward first uses the buckets
(``GradSync._start_weight_gather``). Waiting for all of them before the next forward would leave the
whole gather exposed; instead each unit of the chunk (each transformer layer, the embedding, the final
norm: the chunk's children, a module list's members) waits in its forward pre-hook for the buckets of
the weights it holds, so the first layer runs once the first bucket has arrived while the later ones
travel (Megatron-core waits per bucket in its modules' forward pre-hooks the same way). The weights are
the same, so the numbers are too.

A unit whose forward never runs reads nothing through it: its weights (the last stage's copy of the
tied embedding, which the stage reads as the output layer) are read by the chunk itself. So the first
forward, whose weights are whole from the start, only records which units run; from the next one on
the chunk's own pre-hook waits for the buckets of every weight no running unit holds, and each running
unit for its own. Layers compiled on their own (``models/compiled_layers.py``) compile their forward,
not their hooks, which run eagerly around it.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from megapipe.optim.grad_sync import GradSync


def units(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's children, with a module list's or dict's members in place of the container."""
    out = []
    for child in chunk.children():
        out.extend(child.children() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child])
    return out


class ForwardWaits:
    """The pre-hooks of one chunk's units that wait for their weights' buckets (module docstring)."""

    def __init__(self, sync: GradSync, chunk: nn.Module):
        self.sync, self.chunk = sync, chunk
        self.units = [unit for unit in units(chunk) if sync.bucket_indices(unit.parameters())]
        self._ran: Optional[set[int]] = set()  # ids of the units seen running in the first forward; None after
        self._own: dict[int, set[int]] = {}  # id(unit) -> its buckets, for the units that run
        self._rest: set[int] = set()  # the buckets the chunk waits for itself
        chunk.register_forward_pre_hook(self._before_chunk)
        for unit in self.units:
            unit.register_forward_pre_hook(self._before_unit)

    @property
    def ready(self) -> bool:
        """Whether the first forward has been seen: from now on the hooks wait, not the pass's start."""
        return self._ran is None

    def first_forward_done(self) -> None:
        """Learn from the units the first forward ran which buckets each waits for and which the chunk does."""
        if self.ready:
            return
        running = [unit for unit in self.units if id(unit) in self._ran]
        self._own = {id(unit): self.sync.bucket_indices(unit.parameters()) for unit in running}
        held = {id(p) for unit in running for p in unit.parameters()}
        self._rest = self.sync.bucket_indices(p for p in self.chunk.parameters() if id(p) not in held)
        self._ran = None

    def _before_chunk(self, module, args) -> None:
        if self.ready:
            self.sync.wait_for_buckets(self._rest)

    def _before_unit(self, module, args) -> None:
        if self._ran is not None:
            self._ran.add(id(module))
        else:
            self.sync.wait_for_buckets(self._own.get(id(module), ()))
