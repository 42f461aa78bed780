"""Gradient-accumulation fusion: weight-gradient products added straight into the fp32 main gradients.

Megatron-LM's gradient-accumulation fusion (on by default, ``--no-gradient-accumulation-fusion`` turns it
off). Without it a linear's backward returns its weight gradient in the weight's dtype, a new weight-sized
tensor under bf16, which the gradient sync's hook then adds into the fp32 ``main_grad``: the product is
written, read back and added in a second pass. With it the backward adds the product into ``main_grad``
itself and hands autograd no weight gradient:

* where the matrix product can write fp32 from bf16 or fp16 operands (``torch.addmm(..., out_dtype=)``: on
  CUDA, and on the meta device that stands for an accelerator on a CPU), one product accumulates into
  ``main_grad`` in fp32 and no low-precision weight gradient exists at all (tried once per device and dtype,
  and checked on exact values where the device has them);
* elsewhere (a CPU, which has no such kernel and where an fp32 product of upcast operands runs 2-3x slower),
  and for weights whose dtype is the main gradient's (fp32 training), the product is computed in the weight's
  dtype and added: the numbers of the unfused path, bit for bit.

Whoever owns a weight's main gradient (the chunk's gradient sync, ``optim/grad_sync.py``) opts the weight in
by giving it a ``MainGradTarget`` (attribute ``main_grad_target``); a weight without one gets its gradient
through autograd as before. So does a weight that the model marks ``SUMMED_BY_AUTOGRAD``: one that also gets a
gradient from another use in the same backward (the word embedding that is also the output layer at p = 1),
whose parts autograd sums before the hook adds them, so that fp32 main gradients keep the unfused path's
order of additions and its bits. The owner learns from ``open`` that a backward added a product, and counts the
gradient ready in its post-accumulate-grad hook, which autograd runs once per backward after the weight's
last use even when no gradient reached it: a weight used twice, as the tied word embedding is at p = 1, is
counted once, after both. Products computed outside autograd (a zero-bubble schedule's BW,
``split_backward.py``) call ``close`` once per weight instead. Like Megatron's, the fused path assumes an
accumulating backward (``.backward()``): ``torch.autograd.grad`` through such a linear adds its weight
gradient to ``main_grad`` too.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

TARGET = "main_grad_target"  # the attribute of a weight whose products go into its main gradient
SUMMED_BY_AUTOGRAD = "gradient_summed_by_autograd"  # True: the weight's uses meet in autograd (no target)


@dataclass(frozen=True)
class MainGradTarget:
    """Where the products of one weight go, given by the owner of its main gradient."""

    open: Callable[[], torch.Tensor]  # the main gradient, allocated, about to receive a product
    close: Callable[[], None]  # every product of a BW is in: count the gradient ready


@dataclass(frozen=True)
class WeightGradient:
    """One backward's gradient of a weight, computed when and where it is wanted."""

    compute: Callable[[], torch.Tensor]  # the gradient itself, in the weight's dtype
    accumulate_into: Callable[[torch.Tensor], None]  # main_grad += the gradient, in main_grad's dtype


def main_grad_target(weight: torch.Tensor) -> Optional[MainGradTarget]:
    """The target of ``weight``'s products, or None when its gradient goes through autograd."""
    return getattr(weight, TARGET, None)


def accumulate_product(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``main_grad += a @ b`` in ``main_grad``'s dtype: one product with a wider output where the device
    has it, else the product in the operands' dtype, then added (see the module docstring)."""
    if a.dtype != main_grad.dtype and accumulates_wider(main_grad.device, a.dtype, main_grad.dtype):
        torch.addmm(main_grad, a, b, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(a.mm(b))


@functools.lru_cache(maxsize=None)
def accumulates_wider(device: torch.device, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=c.dtype, out=c)`` adds a product of ``dtype`` operands into
    an ``out_dtype`` tensor in place on ``device``, without rounding it to ``dtype`` first; tried once."""
    with torch.no_grad():
        try:
            a = torch.ones(2, 2, dtype=dtype, device=device)
            c = torch.full((2, 2), 1 + 2.0 ** -20, dtype=out_dtype, device=device)  # needs fp32's mantissa
            torch.addmm(c, a, a, out_dtype=out_dtype, out=c)
            works = device.type == "meta" or bool((c == 3 + 2.0 ** -20).all())
        except (RuntimeError, NotImplementedError, TypeError) as error:
            logger.info("gradient-accumulation fusion on %s: %s products are computed in %s and then added (%s)",
                        device, dtype, dtype, str(error).splitlines()[0])
            return False
    if not works:
        logger.warning("gradient-accumulation fusion on %s: torch.addmm with out_dtype=%s gave a wrong sum; %s "
                       "products are computed in %s and then added", device, out_dtype, dtype, dtype)
    return works
