"""Optimizers, learning-rate schedules, gradient finalisation, clipping and mixed precision.

One training iteration on one rank::

    grads = GradBuffers(model_chunks, ps)                  # one GradSync per chunk: param.main_grad, buckets
    opt = build_optimizer(model_chunks, opt_config, ps, grads)
    sched = LRScheduler(opt, opt_config, train_iters)
    for microbatch in ...:                                  # loss already divided by the microbatch count
        opt.scale_loss(loss).backward()                     # hooks add each param.grad into main_grad
    grads.start_data_parallel_reduce()                      # optional: overlap the DP all-reduce
    finalize_model_grads(model_chunks, ps, grads)           # DP average, tied embedding, sequence parallel
    ok, grad_norm, num_zeros = opt.step()                   # unscale, overflow check, clip, update, copy back
    if not ok and opt.loss_scale is not None:
        log(f"skipped iteration: loss scale reduced to {opt.loss_scale}")
    sched.step()
    opt.zero_grad()

``opt.step()`` returns ``StepResult(ok, grad_norm, num_zeros)``: ``ok`` is False when the
update was skipped because some gradient on some model-parallel rank held inf/NaN (then
``grad_norm`` is None; with fp16 the loss scale backs off) or because the norm itself
overflowed (then ``grad_norm`` is inf). ``num_zeros`` needs ``log_num_zeros_in_grad``.
Checkpoints: ``opt.state_dict()`` / ``load_state_dict()`` (inner optimizer state, fp32 masters,
loss scaler) and ``sched.state_dict()`` / ``load_state_dict()`` (iteration, schedule).

``GradBuffers(..., level=ShardingLevel("optim"))`` shards the optimizer state over the
data-parallel group (ZeRO-1; ``optim_grads`` and ``optim_grads_params`` also the gradients and
the weights): the optimizer then steps this rank's pieces and all-gathers them (``grad_sync.py``).

Parameter attributes read here (set by the model code): ``tensor_model_parallel`` (a shard:
counted in the norm on every tensor rank), ``shared_embedding`` / ``tied_embedding`` (the last /
first stage's copy of the tied word embedding: gradients summed over the embedding group, the
shared copy left out of the norm), ``sequence_parallel`` (gradient summed over the tensor group),
``expert_parallel`` (an expert rank's experts: reduced over the expert-data-parallel group, their
squares summed over the expert group in the norm).
"""

from megapipe.optim.clip import clip_grads_by_total_norm, count_zero_grads, counts_in_norm
from megapipe.config.optimizer import LR_DECAY_STYLES, OPTIMIZERS, OptimizerConfig
from megapipe.optim.finalize import finalize_model_grads
from megapipe.optim.grad_buffer import GradBuffers, trainable_params
from megapipe.optim.grad_sync import GradSync
from megapipe.config.sharding import SHARDING_STRATEGIES, ShardingLevel
from megapipe.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler
from megapipe.optim.lr_schedule import LRSchedule, LRScheduler
from megapipe.optim.optimizer import build_optimizer, weight_decay_groups
from megapipe.optim.precision import PrecisionOptimizer, StepResult

__all__ = [
    "OptimizerConfig", "OPTIMIZERS", "LR_DECAY_STYLES",
    "GradBuffers", "GradSync", "ShardingLevel", "SHARDING_STRATEGIES", "trainable_params", "finalize_model_grads",
    "clip_grads_by_total_norm", "count_zero_grads", "counts_in_norm",
    "ConstantLossScaler", "DynamicLossScaler", "build_loss_scaler",
    "build_optimizer", "weight_decay_groups", "PrecisionOptimizer", "StepResult",
    "LRSchedule", "LRScheduler",
]
