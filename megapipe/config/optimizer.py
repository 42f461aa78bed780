"""OptimizerConfig: the optimizer, learning-rate and loss-scaling flags, validated once.

Field names follow Megatron-LM's flags (``--lr``, ``--min-lr``, ``--clip-grad``,
``--loss-scale-window`` ...); each field's default is its flag's default (``megapipe.cli.flags``
generates the flags from these fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megapipe.config.flag import flag
from megapipe.config.sharding import SHARDING_STRATEGIES, ShardingLevel
from megapipe.errors import ConfigError

OPTIMIZERS = ("adam", "adamw", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


@dataclass
class OptimizerConfig:
    """How parameters are updated: algorithm, precision, clipping and learning-rate schedule.

    ``optimizer="adam"`` is Megatron's adam, which has always been AdamW (weight decay
    decoupled from the gradient: apex FusedAdam's default ``adam_w_mode`` or
    ``torch.optim.AdamW``); ``"adamw"`` is accepted as the same thing under its usual name.
    """

    optimizer: str = flag("adam", choices=OPTIMIZERS)
    lr: Optional[float] = 1e-3  # the peak learning rate
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0  # 0 disables clipping (the norm is still computed and returned)
    log_num_zeros_in_grad: bool = flag(False, name=None)
    # precision and loss scaling (fp16 only; bf16 and fp32 never scale the loss)
    fp16: bool = False
    bf16: bool = False
    # a constant scale; None means dynamic scaling
    loss_scale: Optional[float] = flag(None, help="constant loss scale; dynamic when unset")
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # learning-rate schedule, counted in iterations
    lr_decay_style: str = flag("cosine", choices=LR_DECAY_STYLES)
    # None: min(50, decay iterations // 10), or none with --lr-warmup-fraction (the LR schedule decides)
    lr_warmup_iters: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None  # of the decay iterations
    lr_decay_iters: Optional[int] = None  # defaults to the number of training iterations
    # data parallelism: sharding level, buckets and overlap (Megatron-core's flags)
    data_parallel_sharding_strategy: str = flag("no_shard", help=(
        "what is split over the data-parallel replicas: no_shard, optim (ZeRO-1), optim_grads (ZeRO-2) or "
        "optim_grads_params (ZeRO-3)"))
    # the alias of --data-parallel-sharding-strategy optim
    use_distributed_optimizer: bool = flag(False, help="the same as --data-parallel-sharding-strategy optim")
    # elements; None: Megatron's max(40M, 1M x d)
    ddp_bucket_size: Optional[int] = flag(None, help="elements per data-parallel reduction (default: max(40M, 1M x "
                                                     "data-parallel size))")
    overlap_grad_reduce: bool = flag(False, help="start each bucket's data-parallel reduction during the last "
                                                 "backward before a step")
    overlap_param_gather: bool = flag(False, help="all-gather the updated weight shards after the step; each "
                                                  "chunk's next forward waits")
    accumulate_allreduce_grads_in_fp32: bool = flag(False, help="fp16: accumulate and reduce gradients in fp32 "
                                                                "(bf16 always does)")
    # step each stage eagerly and validate afterwards instead of reducing across stages first
    enable_optimizer_post_validation: bool = flag(False, help=(
        "step each pipeline stage without first reducing the gradient norm and overflow flag across stages; "
        "validate afterwards and redo the step when it clipped or skipped"))

    @property
    def sharding(self) -> ShardingLevel:
        """The sharding level, ``--use-distributed-optimizer`` read as ``optim``."""
        if self.use_distributed_optimizer and self.data_parallel_sharding_strategy == "no_shard":
            return ShardingLevel("optim")
        return ShardingLevel(self.data_parallel_sharding_strategy)

    def bucket_size(self, data_parallel_size: int) -> int:
        """Elements per data-parallel reduction: ``--ddp-bucket-size``, or Megatron's default for d replicas."""
        return self.ddp_bucket_size or max(40_000_000, 1_000_000 * data_parallel_size)

    def grad_dtype(self, params_dtype: torch.dtype) -> torch.dtype:
        """Main gradients are fp32 except for fp16 without ``--accumulate-allreduce-grads-in-fp32``
        (bf16 always accumulates in fp32, as Megatron forces)."""
        if params_dtype == torch.float16 and not self.accumulate_allreduce_grads_in_fp32:
            return torch.float16
        return torch.float32

    def validate(self) -> None:
        """Raise ConfigError (one sentence naming the flag and the fix) for a bad combination."""
        self._validate_optimizer()
        self._validate_precision()
        self._validate_schedule()
        self._validate_data_parallel()

    def check_pipeline_schedule(self, schedule: str, asynchronous: bool) -> None:
        """Refuse a sharding level or post-validation where the named pipeline schedule cannot run it."""
        if self.enable_optimizer_post_validation and asynchronous:
            raise ConfigError(f"--enable-optimizer-post-validation cannot run --pipeline-schedule {schedule}: it "
                              "validates the step that ends a flush, and this schedule has none (each stage "
                              "already updates on its own); drop the flag or use a flush schedule such as zb-h2.")
        if self.sharding.shards_params and asynchronous:
            raise ConfigError(f"--data-parallel-sharding-strategy optim_grads_params cannot run --pipeline-schedule "
                              f"{schedule}: its weight versions are whole copies kept across passes; use optim_grads "
                              "(sharded optimizer state and gradients) or a flush schedule.")

    def _validate_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer {self.optimizer} is unknown; use one of {', '.join(OPTIMIZERS)}.")
        if self.lr is None:
            raise ConfigError("--lr is not set; pass the peak learning rate such as --lr 1e-4.")
        if self.lr < 0 or self.min_lr < 0:
            raise ConfigError(f"--lr {self.lr} and --min-lr {self.min_lr} must not be negative.")
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} exceeds --lr {self.lr}; lower --min-lr.")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay {self.weight_decay} must not be negative.")
        for name, beta in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"{name} {beta} must be in [0, 1).")
        if self.adam_eps <= 0:
            raise ConfigError(f"--adam-eps {self.adam_eps} must be positive.")
        if self.sgd_momentum < 0:
            raise ConfigError(f"--sgd-momentum {self.sgd_momentum} must not be negative.")
        if self.clip_grad < 0:
            raise ConfigError(f"--clip-grad {self.clip_grad} must not be negative; use 0 to disable clipping.")

    def _validate_precision(self) -> None:
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16 and --bf16 were both given; choose one.")
        if self.loss_scale is not None and not self.fp16:
            raise ConfigError(f"--loss-scale {self.loss_scale} only applies with --fp16; drop it or add --fp16.")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"--loss-scale {self.loss_scale} must be positive.")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ConfigError(f"--initial-loss-scale {self.initial_loss_scale} and --min-loss-scale "
                              f"{self.min_loss_scale} must be positive.")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"--min-loss-scale {self.min_loss_scale} exceeds --initial-loss-scale "
                              f"{self.initial_loss_scale}; lower the minimum.")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ConfigError(f"--loss-scale-window {self.loss_scale_window} and --hysteresis {self.hysteresis} "
                              "must be at least 1.")

    def check_post_validation(self, pipeline: int, replicated_stages: bool) -> None:
        """Refuse --enable-optimizer-post-validation where it has nothing to do or cannot chain the stages."""
        if not self.enable_optimizer_post_validation:
            return
        if pipeline < 2:
            raise ConfigError("--enable-optimizer-post-validation needs --pipeline-model-parallel-size of at least "
                              "2: with one stage no step waits for another; drop the flag.")
        if replicated_stages:
            raise ConfigError("--enable-optimizer-post-validation cannot run a --pipeline-stages plan with "
                              "replicated stages: the partial state is handed from stage to stage along one "
                              "pipeline; replicate the whole pipeline (data parallelism) instead.")
        if self.log_num_zeros_in_grad:
            raise ConfigError("--enable-optimizer-post-validation cannot count zero gradients "
                              "(log_num_zeros_in_grad): that count is a reduction across all stages before the "
                              "step; turn the count off.")

    def _validate_schedule(self) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {self.lr_decay_style} is unknown; use one of "
                              f"{', '.join(LR_DECAY_STYLES)}.")
        if self.lr_warmup_fraction is not None and self.lr_warmup_iters:
            raise ConfigError("--lr-warmup-iters and --lr-warmup-fraction were both given; use only one.")
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction < 1.0:
            raise ConfigError(f"--lr-warmup-fraction {self.lr_warmup_fraction} must be in [0, 1).")
        if self.lr_warmup_iters is not None and self.lr_warmup_iters < 0:
            raise ConfigError(f"--lr-warmup-iters {self.lr_warmup_iters} must not be negative.")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            raise ConfigError(f"--lr-decay-iters {self.lr_decay_iters} must be at least 1.")

    def _validate_data_parallel(self) -> None:
        strategy = self.data_parallel_sharding_strategy
        if strategy not in SHARDING_STRATEGIES:
            raise ConfigError(f"--data-parallel-sharding-strategy {strategy} is unknown; use one of "
                              f"{', '.join(SHARDING_STRATEGIES)}.")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size <= 0:
            raise ConfigError(f"--ddp-bucket-size {self.ddp_bucket_size} must be a positive number of elements; "
                              "drop it for Megatron's default.")
        if self.overlap_param_gather and not self.sharding.shards_optimizer:
            raise ConfigError("--overlap-param-gather needs a sharded optimizer; add --use-distributed-optimizer "
                              "(or --data-parallel-sharding-strategy optim, optim_grads or optim_grads_params).")
