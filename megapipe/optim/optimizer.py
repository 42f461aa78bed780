"""Build the optimizer of one rank: weight-decay groups, the fastest available kernel, the wrapper.

Biases and normalization weights (every parameter with fewer than two dimensions) get no
weight decay, as in Megatron. Adam is always AdamW (decoupled decay), which is what Megatron's
``--optimizer adam`` runs. The kernel is torch's fused implementation where torch has one for the
device (CPU and CUDA), else its foreach implementation. apex's ``FusedAdam`` is not used even when
installed: torch's fused kernels are as fast and take the skip flag of an overflowing step on the
device (``found_inf``), so a step never waits for the host; apex's would have to read it.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from megapipe.config.optimizer import OptimizerConfig
from megapipe.optim.grad_buffer import GradBuffers, trainable_params
from megapipe.optim.loss_scaler import build_loss_scaler
from megapipe.optim.precision import PrecisionOptimizer, make_main_param
from megapipe.parallel.state import ParallelState

logger = logging.getLogger(__name__)


def takes_weight_decay(param: torch.Tensor) -> bool:
    """Matrices decay; biases and norm weights (vectors, scalars) do not."""
    return param.ndim >= 2


def weight_decay_groups(model_params: list[torch.nn.Parameter], main_params: list[torch.nn.Parameter],
                        weight_decay: float) -> list[dict]:
    """Param groups over the main params, split by whether the matching model param decays."""
    decay = [main for model, main in zip(model_params, main_params) if takes_weight_decay(model)]
    no_decay = [main for model, main in zip(model_params, main_params) if not takes_weight_decay(model)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_inner_optimizer(groups: list[dict], config: OptimizerConfig,
                          device: torch.device) -> tuple[torch.optim.Optimizer, str]:
    """The torch optimizer over ``groups`` and a short name of the kernel chosen."""
    kernel = {"fused": True} if device.type in _get_fused_kernels_supported_devices() else {"foreach": True}
    kernel_name = next(iter(kernel))
    if config.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, **kernel)
        if config.sgd_momentum:
            start_momentum_at_zero(optimizer)
        return optimizer, f"torch SGD ({kernel_name})"
    betas = (config.adam_beta1, config.adam_beta2)
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=betas, eps=config.adam_eps, **kernel)
    return optimizer, f"torch AdamW ({kernel_name})"


def start_momentum_at_zero(optimizer: torch.optim.SGD) -> None:
    """Give every parameter a zero momentum buffer now, which the first update turns into its gradient (no
    dampening), exactly as torch's first step would. Torch's fused SGD allocates the buffers uninitialized on
    its first call and leaves them so when that step is skipped (``found_inf``: an fp16 overflow), after which
    every update would add uninitialized memory."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def build_optimizer(model_chunks: Iterable[torch.nn.Module], config: OptimizerConfig, ps: ParallelState,
                    grads: GradBuffers) -> PrecisionOptimizer:
    """The optimizer for this rank's chunks, reading gradients from ``grads`` (built on the same chunks)."""
    model_params = trainable_params(model_chunks)
    if list(map(id, model_params)) != list(map(id, grads.params)):
        raise ValueError("build_optimizer got gradient buffers built on other model chunks; "
                         "pass the GradBuffers made from these chunks.")
    if grads.level.shards_optimizer:  # this rank's pieces of the parameters
        model_params = [piece.param for piece in grads.pieces]
        main_params = [make_main_param(piece.param, piece.weight) for piece in grads.pieces]
    else:
        main_params = [make_main_param(p) for p in model_params]
    groups = weight_decay_groups(model_params, main_params, config.weight_decay)
    inner, kernel = build_inner_optimizer(groups, config, grads.device)
    scaler = build_loss_scaler(config)
    precisions = sorted({str(p.dtype).removeprefix("torch.") for p in model_params})
    logger.info("optimizer: %s on %s params%s, %s, data-parallel sharding %s", kernel, "/".join(precisions),
                " with fp32 masters" if any(p.dtype != torch.float32 for p in model_params) else "",
                f"loss scale {config.loss_scale or config.initial_loss_scale:g} ({type(scaler).__name__})" if scaler
                else "no loss scaling",
                grads.level.strategy)
    return PrecisionOptimizer(inner, model_params, main_params, grads, ps, config.clip_grad, scaler,
                              config.log_num_zeros_in_grad)
