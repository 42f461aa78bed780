"""Running the library on a pretend accelerator without one: device readiness and memory on a CPU.

``fake_accelerator()`` enters PyTorch's ``FakeTensorMode``: tensors carry shapes, dtypes and
devices but no data, and any operation that mixes a device tensor with a host tensor (a mask, an
``arange`` or a scale created without ``device=``) raises, as it would on a GPU. The device is
``meta``: a CPU-only PyTorch build cannot index or copy fake tensors that claim to be on ``cuda``
(its Python bindings look for a CUDA device guard, which such a build does not have), while meta
tensors behave like an accelerator's for every check that matters here.

``DeviceMemory`` counts, under that mode, the bytes of every live storage on the device: the
model's weights, gradients, optimizer state and activations, without running a kernel.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FAKE_DEVICE = torch.device("meta")


class HostReads(TorchDispatchMode):
    """Answers reads of a fake value on the host (``.item()``, ``bool(t)``; a synchronisation on an
    accelerator) that fake tensors cannot answer: True for a boolean (``isfinite``: the step is taken),
    1 for a number (a step counter or a norm divides safely; an fp16 overflow flag, a float, then
    reads as an overflow and that step is skipped). ``count`` says how many there were."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_accelerator() -> Iterator[HostReads]:
    """Everything created inside lives on ``FAKE_DEVICE`` or fails loudly when mixed with the host;
    yields the ``HostReads`` that answers (and counts) reads of fake values."""
    reads = HostReads()
    with FakeTensorMode(allow_non_fake_inputs=False), reads:
        yield reads


class DeviceMemory(TorchDispatchMode):
    """Live and peak bytes of the storages on ``device`` created while the mode is active.

    A storage counts from the operation that creates it until its last user (a tensor, a view,
    an autograd node) lets it go, as the caching allocator of an accelerator sees it (less its
    rounding to blocks).
    """

    def __init__(self, device: torch.device = FAKE_DEVICE):
        super().__init__()
        self.device = device
        self.live: dict[int, int] = {}
        self.peak = 0

    @property
    def current(self) -> int:
        return sum(self.live.values())

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device == self.device:
                self._track(tensor.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, self.current)
