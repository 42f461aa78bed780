"""Command-line flags with Megatron-LM's names, parsed once into ``Config``.

``parse_config(kind, argv, world_size)`` reads the flags, fills the dataclasses of
``megapipe.config`` and checks every combination that can be checked before a process
group exists; each mistake is one sentence naming the flags and the fix. With no flags at
all a small model trains on the embedded corpus.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from megapipe.config import Config, DataConfig, ModelConfig, ParallelConfig, ScheduleSearchConfig, TrainingConfig
from megapipe.errors import ConfigError
from megapipe.flops import check_device_peak
from megapipe.llama_flags import apply_preset, llama_flags, llama_options
from megapipe.training.exits import validate_operations
from megapipe.optim.config import LR_DECAY_STYLES, OPTIMIZERS, OptimizerConfig


def build_parser(kind: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"pretrain_{kind}.py", description=f"Pretrain a {kind.upper()} model with "
                                     "tensor, pipeline and data parallelism (Megatron-LM flag names).",
                                     allow_abbrev=False)
    _model_flags(parser.add_argument_group("model"))
    _parallel_flags(parser.add_argument_group("parallelism"))
    _optimizer_flags(parser.add_argument_group("optimizer and precision"))
    _training_flags(parser.add_argument_group("training"))
    _data_flags(parser.add_argument_group("data"))
    _kernel_flags(parser.add_argument_group("kernels and memory"))
    return parser


def _model_flags(g) -> None:
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon", type=float, default=None,
                   help="default 1e-5 (GPT), 1e-12 (BERT)")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--bert-no-binary-head", action="store_true", help="BERT: train masked LM only")
    llama_flags(g)


def _parallel_flags(g) -> None:
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk for the interleaved schedule")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_true")
    g.add_argument("--pipeline-schedule", default=None,
                   help="1f1b (default), gpipe, interleaved (default with virtual stages), zb-h1, zb-h2, "
                        "interleaved-zb, zbv, v-half, v-min, dualpipev (these four: two chunks per rank in a V), "
                        "pipedream, 2bw, or auto (searched for the stage costs below)")
    g.add_argument("--schedule-forward-time", type=_times, default=None,
                   help="auto: forward time of one microbatch per pipeline rank (comma-separated, or one for all)")
    g.add_argument("--schedule-input-backward-time", type=_times, default=None,
                   help="auto: BI (input-gradient) time per rank (default: the forward's)")
    g.add_argument("--schedule-weight-backward-time", type=_times, default=None,
                   help="auto: BW (weight-gradient) time per rank (default: the forward's)")
    g.add_argument("--schedule-latency", type=float, default=0.0, help="auto: time of one pipeline message")
    g.add_argument("--schedule-memory-limit", type=float, default=None,
                   help="auto: most microbatches' activations a rank may hold (default p, 1F1B's peak)")
    g.add_argument("--schedule-profile", default=None,
                   help="auto: take the stage times from this profile (tools/profile_model.py) instead")
    g.add_argument("--schedule-file", default=None,
                   help="run a flush schedule written as text or CSV (see tools/plot_schedule.py) instead of "
                        "--pipeline-schedule; checked deadlock-free under gloo and NCCL before anything runs")
    g.add_argument("--pipedream-vertical-sync", action="store_true",
                   help="pipedream: every stage uses the weight version chosen at the input stage")
    g.add_argument("--pipeline-stages", default=None,
                   help="a stage plan instead of equal stages: layers [start, end) times replicas per stage, "
                        "e.g. 0:12x2,12:24x1, or the JSON file tools/plan.py writes")


def _times(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(","))


def _optimizer_flags(g) -> None:
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="constant loss scale; dynamic when unset")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--data-parallel-sharding-strategy", default="no_shard",
                   help="what is split over the data-parallel replicas: no_shard, optim (ZeRO-1), optim_grads "
                        "(ZeRO-2) or optim_grads_params (ZeRO-3)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="the same as --data-parallel-sharding-strategy optim")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per data-parallel reduction (default: max(40M, 1M x data-parallel size))")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each bucket's data-parallel reduction during the last backward before a step")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="all-gather the updated weight shards after the step; each chunk's next forward waits")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="fp16: accumulate and reduce gradients in fp32 (bf16 always does)")
    g.add_argument("--enable-optimizer-post-validation", action="store_true",
                   help="step each pipeline stage without first reducing the gradient norm and overflow flag "
                        "across stages; validate afterwards and redo the step when it clipped or skipped")


def _training_flags(g) -> None:
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=32)
    g.add_argument("--train-iters", type=int, default=500)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--log-interval", type=int, default=20)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true", help="load weights only; start at iteration 0")
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--device-peak-tflops", type=float, default=None,
                   help="peak dense bf16 TFLOP/s of one device, for model FLOPs utilisation (known GPUs are "
                        "looked up by name)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="how long a collective waits for a peer before failing")
    g.add_argument("--exit-interval", type=int, default=None, help="save (with --save) and exit every N iterations")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit once training has run this long")
    g.add_argument("--skip-train", action="store_true",
                   help="evaluate the --load checkpoint on the validation and test sets without training")
    g.add_argument("--override-opt-param-scheduler", action="store_true",
                   help="on resume, take the learning-rate schedule from the flags, not the checkpoint")
    g.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true",
                   help="on resume, take the learning-rate schedule from the checkpoint, not the flags")
    g.add_argument("--cluster-lease", default=None, metavar="ADDRESS",
                   help="run under a lease of the cluster scheduler at this http:// address: report progress, "
                        "renew before the lease ends, else save and exit (set by tools/cluster.py)")


def _data_flags(g) -> None:
    g.add_argument("--data-path", nargs="*", default=[],
                   help="prefix, or weight/prefix pairs; the embedded corpus when omitted")
    g.add_argument("--split", default=None,
                   help="train,valid,test weights over documents; default 969,30,1 (90,5,5 for the embedded corpus)")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--mask-prob", type=float, default=0.15)
    g.add_argument("--short-seq-prob", type=float, default=0.1)
    g.add_argument("--mock-data", action="store_true", help="GPT: synthetic random tokens instead of --data-path")
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary of --mock-data")


def _kernel_flags(g) -> None:
    g.add_argument("--no-bias-gelu-fusion", action="store_true")
    g.add_argument("--no-bias-dropout-fusion", action="store_true")
    g.add_argument("--no-masked-softmax-fusion", action="store_true")
    g.add_argument("--no-bias-swiglu-fusion", action="store_true")
    g.add_argument("--no-rope-fusion", action="store_true")
    g.add_argument("--fusion-backend", choices=("auto", "apex", "triton", "compile", "eager"), default="auto")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)


def _virtual_pipeline_size(args) -> int:
    if args.num_layers_per_virtual_pipeline_stage is None:
        return 1
    per_chunk, p = args.num_layers_per_virtual_pipeline_stage, args.pipeline_model_parallel_size
    if per_chunk < 1 or args.num_layers % (p * per_chunk):
        raise ConfigError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {p} x "
                          f"--num-layers-per-virtual-pipeline-stage {per_chunk}; every model chunk must hold the "
                          "same number of layers.")
    return args.num_layers // (p * per_chunk)


def config_from_args(kind: str, args: argparse.Namespace) -> Config:
    v = _virtual_pipeline_size(args)
    schedule = args.pipeline_schedule or ("interleaved" if v > 1 else "1f1b")
    bert = kind == "bert"
    model = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.layernorm_epsilon or (1e-12 if bert else 1e-5), normalization=args.normalization,
        activation="gelu" if bert else "gelu_tanh", post_layernorm=bert,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        num_tokentypes=2 if bert else 0, bert_binary_head=not args.bert_no_binary_head,
        init_method_std=args.init_method_std,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32,
        bias_gelu_fusion=not args.no_bias_gelu_fusion, bias_dropout_fusion=not args.no_bias_dropout_fusion,
        masked_softmax_fusion=not args.no_masked_softmax_fusion,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers, **llama_options(args))
    parallel = ParallelConfig(tensor=args.tensor_model_parallel_size, pipeline=args.pipeline_model_parallel_size,
                              virtual_pipeline=v, sequence_parallel=args.sequence_parallel,
                              scatter_gather_tensors_in_pipeline=not args.no_scatter_gather_tensors_in_pipeline,
                              pipeline_schedule=schedule, pipedream_vertical_sync=args.pipedream_vertical_sync,
                              pipeline_stages=args.pipeline_stages, schedule_file=args.schedule_file,
                              schedule_search=ScheduleSearchConfig(
                                  forward_time=args.schedule_forward_time,
                                  input_backward_time=args.schedule_input_backward_time,
                                  weight_backward_time=args.schedule_weight_backward_time,
                                  latency=args.schedule_latency, memory_limit=args.schedule_memory_limit,
                                  profile=args.schedule_profile))
    optimizer = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, fp16=args.fp16, bf16=args.bf16,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis, lr_decay_style=args.lr_decay_style,
        lr_warmup_iters=args.lr_warmup_iters if args.lr_warmup_iters is not None else
        (0 if args.lr_warmup_fraction is not None else min(50, args.train_iters // 10)),
        lr_warmup_fraction=args.lr_warmup_fraction, lr_decay_iters=args.lr_decay_iters,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        use_distributed_optimizer=args.use_distributed_optimizer, ddp_bucket_size=args.ddp_bucket_size,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
        accumulate_allreduce_grads_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        enable_optimizer_post_validation=args.enable_optimizer_post_validation)
    # the embedded corpus has only a few thousand documents (79 for BERT): Megatron's 969,30,1
    # would leave its test split empty
    split = args.split or ("969,30,1" if args.data_path else "90,5,5")
    data = DataConfig(data_path=list(args.data_path), split=split, tokenizer_type=args.tokenizer_type,
                      vocab_file=args.vocab_file, merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                      data_cache_path=args.data_cache_path, mask_prob=args.mask_prob,
                      short_seq_prob=args.short_seq_prob, mock_data=args.mock_data, vocab_size=args.vocab_size)
    training = TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        log_interval=args.log_interval, seed=args.seed, save=args.save, load=args.load,
        save_interval=args.save_interval, no_save_optim=args.no_save_optim, no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng, finetune=args.finetune, async_save=args.async_save,
        wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name, wandb_save_dir=args.wandb_save_dir,
        tensorboard_dir=args.tensorboard_dir, device_peak_tflops=args.device_peak_tflops,
        fusion_backend=args.fusion_backend, distributed_timeout_minutes=args.distributed_timeout_minutes,
        exit_interval=args.exit_interval, exit_duration_in_mins=args.exit_duration_in_mins,
        skip_train=args.skip_train, override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler, cluster_lease=args.cluster_lease)
    return Config(model=model, parallel=parallel, data=data, training=training, optimizer=optimizer)


def validate_config(config: Config, world_size: int, kind: str = "gpt", ranks_per_node: Optional[int] = None) -> int:
    """Check everything knowable before process groups exist; returns the data-parallel size.

    ``ranks_per_node`` (torchrun's LOCAL_WORLD_SIZE) adds the checks of how the layout sits on
    nodes; a tensor-parallel group across nodes is warned about on stderr by rank 0."""
    from megapipe.layout.nodes import check_nodes
    from megapipe.layout.ranks import RankLayout
    from megapipe.layout.plan import PlanLayout
    from megapipe.pipeline.ir.schedules import build_schedule, schedule_spec
    from megapipe.pipeline.selection import AUTO, check_profile, check_search_flags, searched_schedule

    par, train = config.parallel, config.training
    warning = check_nodes(world_size, ranks_per_node, par.tensor, par.pipeline)
    if warning and os.environ.get("RANK", "0") == "0":
        print(warning, file=sys.stderr, flush=True)
    plan = par.stage_plan()
    if plan is None:
        layout = RankLayout.for_world(world_size, par.tensor, par.pipeline)
        par.validate()
        config.model.validate(par.tensor, par.pipeline, par.virtual_pipeline)
        data, pipeline, replicas = layout.data, par.pipeline, None
    else:
        par.validate(world_size, config.model.num_layers)
        config.model.validate(par.tensor)  # stages need not hold equal numbers of layers
        layout = PlanLayout(plan, par.tensor)
        data, pipeline, replicas = layout.data_size, layout.pipeline_size, layout.stage_replicas
    config.optimizer.validate()
    config.optimizer.check_post_validation(pipeline, replicas is not None and max(replicas) > 1)
    for flag, value in (("--micro-batch-size", train.micro_batch_size), ("--train-iters", train.train_iters),
                        ("--log-interval", train.log_interval), ("--eval-interval", train.eval_interval)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1.")
    if par.sequence_parallel and config.model.seq_length % par.tensor:
        raise ConfigError(f"--seq-length {config.model.seq_length} is not divisible by --tensor-model-parallel-size "
                          f"{par.tensor}, which --sequence-parallel needs.")
    if train.save_interval is not None and not train.save:
        raise ConfigError("--save-interval needs --save DIR to know where to write checkpoints.")
    check_device_peak(train.device_peak_tflops)
    validate_operations(kind, config)
    m = train.num_microbatches(data)
    check_search_flags(config, pipeline)
    if par.pipeline_schedule == AUTO:
        if par.schedule_search.profile is None:
            searched_schedule(kind, config, pipeline, m, par.virtual_pipeline)
        else:  # searched once the tokenizer has given the vocabulary the profile must match
            check_profile(kind, config)
        config.optimizer.check_pipeline_schedule(AUTO, False)
        return data
    # m vs p rules, unknown names, replicas that only an asynchronous schedule can run
    build_schedule(par.pipeline_schedule, pipeline, m, par.virtual_pipeline, replicas=replicas,
                   vertical_sync=par.pipedream_vertical_sync)
    config.optimizer.check_pipeline_schedule(par.pipeline_schedule, schedule_spec(par.pipeline_schedule).asynchronous)
    return data


def parse_config(kind: str, argv: Optional[Sequence[str]] = None, world_size: int = 1,
                 ranks_per_node: Optional[int] = None) -> Config:
    parser = build_parser(kind)
    args = apply_preset(parser.parse_args(argv), parser.parse_args([]))
    config = config_from_args(kind, args)
    validate_config(config, world_size, kind, ranks_per_node)
    return config
