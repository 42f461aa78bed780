"""Running the library on a pretend accelerator without one: device readiness and memory on a CPU.

``fake_accelerator()`` enters PyTorch's ``FakeTensorMode``: tensors carry shapes, dtypes and
devices but no data, and any operation that mixes a device tensor with a host tensor (a mask, an
``arange`` or a scale created without ``device=``) raises, as it would on a GPU; so does a random
draw into a device tensor from a host generator (``DeviceGenerators``). The device is
``meta``: a CPU-only PyTorch build cannot index or copy fake tensors that claim to be on ``cuda``
(its Python bindings look for a CUDA device guard, which such a build does not have), while meta
tensors behave like an accelerator's for every check that matters here.

``DeviceMemory`` counts, under that mode, the bytes of every live storage on the device: the
model's weights, gradients, optimizer state and activations, without running a kernel, and a storage
resized in place (ZeRO's released buffers) at its new size.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FAKE_DEVICE = torch.device("meta")
# the operations that read a value on the host (``bool(t)`` is ``is_nonzero`` under inference mode)
READS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)
# the operations that copy a tensor (``.to(device)``, ``.cpu()``; ``dst[...] = src`` is ``copy_(dst, src)``)
COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


class HostReads(TorchDispatchMode):
    """Answers reads of a fake value on the host (``.item()``, ``bool(t)``) that fake tensors cannot
    answer: ``booleans`` for a boolean (True: ``isfinite`` holds and the step is taken; False: a
    decode's done flags never all hold, so it runs to its length); for a number, the next of
    ``numbers`` while they last (control words a test scripts), then 1 (a step counter or a norm
    divides safely; an fp16 overflow flag, a float, then reads as an overflow and that step is
    skipped). ``count`` says how many times the host waited for the device: reads of a device value
    and copies between host and device (an accelerator's copy from pageable host memory waits for
    its stream too); a read of a host value waits for nothing and is not counted."""

    def __init__(self, booleans: bool = True, numbers: Iterable[int] = ()):
        super().__init__()
        self.booleans = booleans
        self.numbers = iter(numbers)
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            on_device = args[0].device == FAKE_DEVICE
            self.count += on_device
            if args[0].dtype == torch.bool or func is torch.ops.aten.is_nonzero.default:
                return self.booleans
            return next(self.numbers, 1) if on_device else 1
        out = func(*args, **kwargs)
        if func in COPIES:  # source and result (or destination) on either side of the host/device line
            sides = {t.device == FAKE_DEVICE for t in (*args[:2], out) if isinstance(t, torch.Tensor)}
            self.count += len(sides) == 2
        return out


_TorchGenerator = torch.Generator


class _GeneratorType(type(_TorchGenerator)):
    def __instancecheck__(cls, instance) -> bool:  # every generator still counts as a torch.Generator
        return isinstance(instance, _TorchGenerator)


class _Generator(_TorchGenerator, metaclass=_GeneratorType):
    """``torch.Generator`` under ``fake_accelerator``. PyTorch makes no generator for the meta device
    (whose kernels draw no numbers), so one asked for on ``FAKE_DEVICE`` is a host generator that
    reports ``FAKE_DEVICE`` as its device, which ``DeviceGenerators`` then holds it to."""

    def __new__(cls, device="cpu"):
        asked = torch.device(device)
        generator = super().__new__(cls, device="cpu" if asked == FAKE_DEVICE else asked)
        generator.asked = asked
        return generator

    @property
    def device(self) -> torch.device:
        return self.asked


class GeneratorDeviceMismatch(RuntimeError):
    """A random draw into a tensor from a generator on another device (which a GPU refuses)."""


class DeviceGenerators(TorchFunctionMode):
    """Refuses a draw whose ``generator=`` lives on another device than the tensors it fills. Fake
    kernels draw no numbers (and some refuse a generator), so the draw runs without it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        generator = kwargs.pop("generator", None)
        out = func(*args, **kwargs)
        if isinstance(generator, _TorchGenerator):
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.device != generator.device:
                    raise GeneratorDeviceMismatch(
                        f"{getattr(func, '__name__', func)} drew numbers for a tensor on {tensor.device} from a "
                        f"generator on {generator.device}; make the generator with device= the tensor's device.")
        return out


@contextlib.contextmanager
def fake_accelerator(booleans: bool = True, numbers: Iterable[int] = ()) -> Iterator[HostReads]:
    """Everything created inside lives on ``FAKE_DEVICE`` or fails loudly when mixed with the host;
    yields the ``HostReads`` that answers (see there for ``booleans`` and ``numbers``) and counts
    reads of fake values."""
    reads = HostReads(booleans, numbers)
    with FakeTensorMode(allow_non_fake_inputs=False), reads, DeviceGenerators(), \
            mock.patch.object(torch, "Generator", _Generator):
        yield reads


_SDPA = torch.nn.functional.scaled_dot_product_attention


def _flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **options):
    """``scaled_dot_product_attention`` as CUDA runs it without a mask: the flash kernel."""
    if attn_mask is not None:
        return _SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **options)
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]


@contextlib.contextmanager
def flash_attention() -> Iterator[None]:
    """``scaled_dot_product_attention`` on ``FAKE_DEVICE`` as a GPU runs it for unmasked half-precision
    attention, the flash kernel (log-sum-exp kept); the fake device would pick the math kernel, which keeps
    the [s, s] scores."""
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _flash_attention):
        yield


@contextlib.contextmanager
def fused_optimizers() -> Iterator[None]:
    """Torch's fused optimizer kernels on ``FAKE_DEVICE`` too, as on a GPU: its foreach kernels, chosen on a
    device without fused ones, allocate a parameter-sized temporary per moment that a GPU's step never holds."""
    devices = [*torch.utils._foreach_utils._get_fused_kernels_supported_devices(), FAKE_DEVICE.type]
    with mock.patch("torch.optim.optimizer._get_fused_kernels_supported_devices", return_value=devices), \
            mock.patch("megapipe.optim.optimizer._get_fused_kernels_supported_devices", return_value=devices):
        yield


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

    def __enter__(self):
        # a storage resized in place (a sharded weight or gradient buffer freed with ``resize_(0)`` and grown
        # back before its next use) is no operator the mode sees: its new size is noted here
        resize = torch.UntypedStorage.resize_

        def resized(storage, size):
            result = resize(storage, size)
            if id(storage) in self.live:
                self.live[id(storage)] = storage.nbytes()
                self.peak = max(self.peak, self.current)
            return result
        self._resizing = mock.patch.object(torch.UntypedStorage, "resize_", resized)
        self._resizing.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self._resizing.stop()
        return super().__exit__(*exc)

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        weakref.finalize(storage, self.live.pop, key, None)
        self.peak = max(self.peak, self.current)
