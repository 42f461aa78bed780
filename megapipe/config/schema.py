"""Configuration dataclasses: one source of truth, validated once, before any process group.

Each field carries its default and its Megatron-LM flag (``megapipe.config.flag``); the
parser of ``megapipe.cli.flags`` is generated from them, so the command line and the
dataclasses cannot give different defaults. A model family's own defaults (BERT's epsilon,
activation, token types ...) live in its registry entry (``megapipe.models.families``).
Library code takes the dataclass. Every validation error is one sentence that names the flag
and the fix.
"""

from __future__ import annotations

import datetime

import math
from argparse import BooleanOptionalAction
from dataclasses import dataclass, field
from typing import Optional

import torch

from megapipe.errors import ConfigError
from megapipe.config.flag import flag
from megapipe.config.moe import LayerFreq, layer_freq, moe_layer_pattern, validate_moe
from megapipe.config.optimizer import OptimizerConfig
from megapipe.layout.context_comm import COMM_TYPES, check_comm_type
from megapipe.layout.stage_plan import StagePlan, equal_split, read_stage_plan
from megapipe.schedules.catalog import (default_schedule, names_where, pipeline_schedule_help, schedule_descriptor,
                                         schedule_names)

KERNELS = "kernels and memory"  # the --help section of the fusion and recomputation flags
MOE = "mixture of experts"  # the --help section of the MoE flags

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # how long a collective waits for a peer, unless a flag says


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Round the vocabulary up to a multiple of ``divisible_by * t`` (Megatron's rule).

    Each tensor rank then holds an equal, well-aligned slice of the embedding.
    """
    if vocab_size < 1:
        raise ConfigError(f"vocabulary size {vocab_size} must be positive; check the tokenizer or --vocab-size.")
    if divisible_by < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by {divisible_by} must be at least 1.")
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass
class ModelConfig:
    """Shape and numerics of a GPT or BERT transformer."""

    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    vocab_size: int = flag(256, name=None)  # from the tokenizer
    seq_length: int = 128
    max_position_embeddings: Optional[int] = flag(None, help="default --seq-length")
    ffn_hidden_size: Optional[int] = flag(None, help="default 4 x hidden size")
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = flag(1e-5, aliases=("--norm-epsilon",))
    normalization: str = flag("LayerNorm", choices=("LayerNorm", "RMSNorm"))
    activation: str = flag("gelu_tanh", name=None)  # GPT-2's gelu_new; BERT uses exact "gelu" (its family's)
    post_layernorm: bool = flag(False, name=None)  # True: original BERT (LayerNorm after each residual add)
    untie_embeddings_and_output_weights: bool = False
    # Llama-family options (Megatron-LM's flags of the same names)
    position_embedding_type: str = flag("learned_absolute", choices=("learned_absolute", "rope", "none"))
    rotary_base: float = 10000.0
    rotary_percent: float = flag(1.0, help="fraction of each head's channels RoPE rotates")
    swiglu: bool = flag(False, help="SwiGLU MLP of width --ffn-hidden-size")
    num_query_groups: Optional[int] = flag(None, help="key/value heads with --group-query-attention")
    add_bias_linear: bool = flag(True, name="--disable-bias-linear", negate=True,
                                 help="no bias in any linear layer")
    add_qkv_bias: bool = flag(False, help="a QKV bias even with --disable-bias-linear (Qwen2)")
    qk_layernorm: bool = flag(False, help="normalise queries and keys before attention (Qwen3, OLMoE)")
    qk_layernorm_scope: str = flag("head", choices=("head", "projection"), help=(
        "with --qk-layernorm: a norm per head over its channels (Qwen3) or over the whole q and k projections "
        "(OLMoE; needs t = 1)"))
    # mixture of experts (megapipe/models/moe; Megatron-LM's flags of the same names)
    num_experts: Optional[int] = flag(None, group=MOE, help="experts per MoE layer (unset: dense MLPs)")
    moe_ffn_hidden_size: Optional[int] = flag(None, group=MOE, help="each expert's hidden size (default "
                                                                    "--ffn-hidden-size)")
    moe_router_topk: int = flag(2, group=MOE, help="experts each token is routed to")
    moe_router_score_function: str = flag("softmax", choices=("softmax", "sigmoid"), group=MOE)
    moe_router_pre_softmax: bool = flag(False, group=MOE, help="softmax over all experts before the top-k (else "
                                                               "over the k chosen)")
    moe_router_num_groups: Optional[int] = flag(None, group=MOE, help="group-limited routing: expert groups")
    moe_router_group_topk: Optional[int] = flag(None, group=MOE, help="group-limited routing: groups per token")
    moe_router_enable_expert_bias: bool = flag(False, group=MOE, help=(
        "DeepSeek-V3's auxiliary-loss-free balancing: a per-expert routing bias moved after each step"))
    moe_router_bias_update_rate: float = flag(1e-3, group=MOE)
    moe_router_load_balancing_type: str = flag("aux_loss", choices=("aux_loss", "seq_aux_loss", "none"),
                                               group=MOE)
    moe_aux_loss_coeff: float = flag(0.0, group=MOE)
    moe_z_loss_coeff: Optional[float] = flag(None, group=MOE)
    moe_expert_capacity_factor: Optional[float] = flag(None, group=MOE, help="drop tokens beyond this multiple of "
                                                                             "an expert's even share")
    moe_token_drop_policy: str = flag("probs", choices=("probs", "position"), group=MOE)
    moe_pad_expert_input_to_capacity: bool = flag(False, group=MOE)
    moe_shared_expert_intermediate_size: Optional[int] = flag(None, group=MOE, help="hidden size of the shared "
                                                                                    "expert every token passes")
    moe_shared_expert_gate: bool = flag(False, group=MOE, help="scale the shared expert by a sigmoid gate "
                                                               "(Qwen2-MoE)")
    moe_layer_freq: LayerFreq = flag(1, type=layer_freq, group=MOE, help=(
        "N: every N-th layer from layer 0 is an MoE layer; or one 0/1 per layer, e.g. 1,0,1,0"))
    moe_grouped_gemm: bool = flag(False, group=MOE, help="run the experts as one grouped matrix product "
                                                         "(torch._grouped_mm) where the build has it")
    moe_token_dispatcher_type: str = flag("alltoall", choices=("allgather", "alltoall"), group=MOE)
    moe_dropless_device_dispatch: bool = flag(False, group=MOE, help=(
        "alltoall: exchange the token counts on the device and send each expert rank a buffer sized for the worst "
        "case, so no count is read on the host and no token dropped (more bytes on the wire; docs/moe.md)"))
    num_tokentypes: int = flag(0, name=None)  # BERT: 2 (its family's)
    bert_binary_head: bool = flag(True, name="--bert-no-binary-head", negate=True, help="BERT: train masked LM only")
    init_method_std: float = 0.02
    params_dtype: torch.dtype = flag(torch.float32, name=None)  # from --bf16 / --fp16
    # kernels and memory (megapipe.fusions, recomputation)
    bias_gelu_fusion: bool = flag(True, name="--no-bias-gelu-fusion", negate=True, group=KERNELS)
    bias_dropout_fusion: bool = flag(True, name="--no-bias-dropout-fusion", negate=True, group=KERNELS)
    masked_softmax_fusion: bool = flag(True, name="--no-masked-softmax-fusion", negate=True, group=KERNELS)
    bias_swiglu_fusion: bool = flag(True, name="--no-bias-swiglu-fusion", negate=True, group=KERNELS)
    apply_rope_fusion: bool = flag(True, name="--no-rope-fusion", negate=True, group=KERNELS)
    gradient_accumulation_fusion: bool = flag(True, name="--no-gradient-accumulation-fusion", negate=True,
                                              group=KERNELS, help="weight gradients made in the weights' dtype and "
                                                                  "then added into the fp32 main gradients, instead "
                                                                  "of accumulated there by their matrix products")
    cross_entropy_loss_fusion: bool = flag(True, name="--no-cross-entropy-loss-fusion", negate=True, group=KERNELS,
                                           help="fp32 copy of the logits in the loss instead of one read of "
                                                "them per pass")
    recompute_granularity: Optional[str] = flag(None, choices=("full", "selective"), group=KERNELS)
    recompute_method: Optional[str] = flag(None, choices=("uniform", "block"), group=KERNELS)
    recompute_num_layers: Optional[int] = flag(None, group=KERNELS)

    def __post_init__(self):
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if isinstance(self.moe_layer_freq, list):  # read back from JSON
            self.moe_layer_freq = tuple(self.moe_layer_freq)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups`` under grouped-query attention, else one per head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (even, as the rotation pairs them)."""
        return int(self.head_dim * self.rotary_percent) // 2 * 2

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has a mixture of experts instead of a dense MLP."""
        return self.num_experts is not None and moe_layer_pattern(self.moe_layer_freq, self.num_layers)[layer]

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tensor_parallel)

    def validate(self, tensor_parallel: int = 1, pipeline_parallel: int = 1, virtual_pipeline: int = 1,
                 expert_parallel: int = 1) -> None:
        t = tensor_parallel
        for name, value in (("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                            ("--num-attention-heads", self.num_attention_heads), ("--seq-length", self.seq_length)):
            if value < 1:
                raise ConfigError(f"{name} {value} must be at least 1.")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                              f"{self.num_attention_heads}; pick a hidden size that is a multiple of the head count.")
        if self.hidden_size % t:
            raise ConfigError(f"--hidden-size {self.hidden_size} is not divisible by --tensor-model-parallel-size {t}.")
        if self.num_attention_heads % t:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                              f"--tensor-model-parallel-size {t}; each tensor rank must hold whole heads.")
        self._validate_llama_options(t)
        if self.ffn_hidden_size % t:
            raise ConfigError(f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                              f"--tensor-model-parallel-size {t}.")
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError(f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                              f"{self.max_position_embeddings}; raise the latter or shorten the sequence.")
        if self.num_layers % (pipeline_parallel * virtual_pipeline):
            what = (f"--pipeline-model-parallel-size {pipeline_parallel}" if virtual_pipeline == 1 else
                    f"--pipeline-model-parallel-size {pipeline_parallel} x {virtual_pipeline} virtual stages")
            raise ConfigError(f"--num-layers {self.num_layers} is not divisible by {what}; "
                              "every stage must hold the same number of layers.")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"--normalization {self.normalization} is unknown; use LayerNorm or RMSNorm.")
        self._validate_recompute()
        if self.num_experts is not None:
            validate_moe(self, t, expert_parallel)
        elif expert_parallel > 1:
            raise ConfigError(f"--expert-model-parallel-size {expert_parallel} needs --num-experts (the experts it "
                              "splits); add it or drop the expert size.")
        if self.activation not in ("gelu", "gelu_tanh"):
            raise ConfigError(f"activation {self.activation} is unknown; use gelu or gelu_tanh.")
        self.padded_vocab_size(t)

    def _validate_llama_options(self, t: int) -> None:
        groups = self.query_groups
        if groups < 1 or self.num_attention_heads % groups:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                              f"--num-query-groups {groups}; each query group must hold the same number of heads.")
        if groups % t:
            raise ConfigError(f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {t}; "
                              "each tensor rank must hold whole query groups, so use a multiple of t groups.")
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ConfigError(f"--position-embedding-type {self.position_embedding_type} is unknown; use "
                              "learned_absolute, rope or none.")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"--rotary-percent {self.rotary_percent} is outside (0, 1]; give the fraction of each "
                              "head's channels to rotate, e.g. 1.0 or 0.5.")
        if self.qk_layernorm and self.qk_layernorm_scope == "projection" and t > 1:
            raise ConfigError("--qk-layernorm-scope projection normalises across all heads, which needs "
                              "--tensor-model-parallel-size 1; use t = 1 or --qk-layernorm-scope head.")
        if self.position_embedding_type == "rope" and self.rotary_dim < 2:
            raise ConfigError(f"--rotary-percent {self.rotary_percent} of head size {self.head_dim} rotates no "
                              "channel pair; raise it.")

    def _validate_recompute(self) -> None:
        granularity, method = self.recompute_granularity, self.recompute_method
        if granularity not in (None, "full", "selective"):
            raise ConfigError(f"--recompute-granularity {granularity} is unknown; use full or selective.")
        if granularity == "full" and method not in ("uniform", "block"):
            raise ConfigError("--recompute-granularity full needs --recompute-method uniform or block.")
        if granularity != "full" and (method is not None or self.recompute_num_layers is not None):
            raise ConfigError("--recompute-method and --recompute-num-layers apply only to "
                              "--recompute-granularity full.")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ConfigError(f"--recompute-num-layers {self.recompute_num_layers} must be at least 1.")


def times(text: str) -> tuple[float, ...]:
    """A comma-separated list of times (one per pipeline rank, or one for all)."""
    return tuple(float(part) for part in text.split(","))


@dataclass
class ScheduleSearchConfig:
    """Inputs of ``--pipeline-schedule auto`` (``cli/selection.py``): per-rank times or a profile."""

    forward_time: Optional[tuple] = flag(None, name="--schedule-forward-time", type=times, help=(
        "auto: forward time of one microbatch per pipeline rank (comma-separated, or one for all)"))
    input_backward_time: Optional[tuple] = flag(None, name="--schedule-input-backward-time", type=times,
                                                help="auto: BI (input-gradient) time per rank (default: the forward's)")
    weight_backward_time: Optional[tuple] = flag(None, name="--schedule-weight-backward-time", type=times,
                                                 help="auto: BW (weight-gradient) time per rank (default: the "
                                                      "forward's)")
    latency: float = flag(0.0, name="--schedule-latency", help="auto: time of one pipeline message")
    memory_limit: Optional[float] = flag(None, name="--schedule-memory-limit", help=(
        "auto: most microbatches' activations a rank may hold (default p, 1F1B's peak)"))
    profile: Optional[str] = flag(None, name="--schedule-profile", help=(
        "auto: take the stage times from this profile (tools/profile_model.py) instead"))

    def given(self) -> bool:
        return self != ScheduleSearchConfig()


@dataclass
class ParallelConfig:
    """Parallel degrees and how the pipeline runs."""

    tensor: int = flag(1, name="--tensor-model-parallel-size")
    pipeline: int = flag(1, name="--pipeline-model-parallel-size")
    data: Optional[int] = flag(None, name=None)  # defaults to world_size / (tensor * pipeline)
    virtual_pipeline: int = flag(1, name=None)  # from --num-layers-per-virtual-pipeline-stage
    expert: int = flag(1, name="--expert-model-parallel-size", help=(
        "ranks the experts of each MoE layer are split over; carved out of the data-parallel ranks (docs/moe.md)"))
    expert_tensor: Optional[int] = flag(None, name="--expert-tensor-parallel-size", help=(
        "ranks each expert's ffn dimension is split over: --tensor-model-parallel-size (the default) or a divisor of "
        "it, each group of that many tensor ranks dispatching its share of the tokens (docs/moe.md)"))
    sequence_parallel: bool = False
    async_tensor_model_parallel_allreduce: bool = flag(True, name="--no-async-tensor-model-parallel-allreduce",
                                                       negate=True, help=(
        "reduce the column-parallel linears' input gradients after their backward instead of behind its "
        "weight-gradient product (the same numbers; for comparisons, docs/parallelism.md)"))
    async_tensor_parallel: bool = flag(False, help=(
        "run sequence parallelism's collective matmuls through torch's symmetric memory (fused_all_gather_matmul, "
        "fused_matmul_reduce_scatter: the GPUs read each other's buffers) instead of point-to-point rings; CUDA "
        "only (docs/parallelism.md)"))
    # context parallelism: each sequence split over c ranks of a replica (layout/context.py, layout/context_comm.py)
    context_parallel_size: int = flag(1, help=(
        "ranks each sequence is split over (2c chunks, rank i holding chunks i and 2c-1-i); they sit between the "
        "tensor and the data ranks, and gradients are averaged over data x context ranks (docs/parallelism.md)"))
    cp_comm_type: str = flag("p2p", choices=COMM_TYPES, help=(
        "how context ranks exchange keys and values: p2p (ring), all_gather, a2a (all-to-all over heads, "
        "Ulysses), a2a+p2p (all-to-all inside groups, ring across them)"))
    hierarchical_context_parallel_sizes: Optional[tuple[int, ...]] = flag(None, type=int, nargs="+", metavar="N",
                                                                           help=(
        "a2a+p2p: the all-to-all size and the ring size, whose product is --context-parallel-size"))
    overlap_moe_expert_parallel_comm: bool = flag(False, help=(
        "run the schedule's forward/backward pairs (1F1B's steady state, DualPipeV's F & B) overlapped, one "
        "microbatch's expert all-to-all beside the other's compute (docs/moe.md)"))
    scatter_gather_tensors_in_pipeline: bool = flag(True, name="--no-scatter-gather-tensors-in-pipeline", negate=True)
    pipeline_schedule: Optional[str] = flag(None, help=pipeline_schedule_help())
    # PipeDream: every stage uses the version tagged at the input stage
    pipedream_vertical_sync: bool = flag(False, help="pipedream: every stage uses the weight version chosen at "
                                                     "the input stage")
    pipeline_stages: Optional[str] = flag(None, help=(  # a stage plan (layout/stage_plan.py)
        "a stage plan instead of equal stages: layers [start, end) times replicas per stage, e.g. 0:12x2,12:24x1, "
        "or the JSON file tools/plan.py writes"))
    schedule_file: Optional[str] = flag(None, help=(
        "run a flush schedule written as text or CSV (see tools/plot_schedule.py) instead of --pipeline-schedule; "
        "checked deadlock-free under gloo and NCCL before anything runs"))
    # for schedule "auto"; its own fields carry the --schedule-* flags
    schedule_search: ScheduleSearchConfig = flag(name=None, default_factory=ScheduleSearchConfig)

    def __post_init__(self):
        if self.hierarchical_context_parallel_sizes is not None:
            self.hierarchical_context_parallel_sizes = tuple(self.hierarchical_context_parallel_sizes)
        if self.pipeline_schedule is None:
            self.pipeline_schedule = default_schedule(self.virtual_pipeline)

    def _descriptor_has(self, fact: str) -> bool:
        """Whether the named schedule has a descriptor property (``auto`` and files have none)."""
        return self.pipeline_schedule in schedule_names() and getattr(schedule_descriptor(self.pipeline_schedule), fact)

    def validate(self, world_size: Optional[int] = None, num_layers: Optional[int] = None) -> None:
        """Check the flags; with the world size and the model's layers, check the stage plan against them too."""
        if self.sequence_parallel and self.tensor == 1:
            raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1; drop the flag or raise t.")
        if self.async_tensor_parallel and not (self.sequence_parallel and self.async_tensor_model_parallel_allreduce):
            raise ConfigError("--async-tensor-parallel runs sequence parallelism's forward collectives fused with "
                              "their products, so it needs --sequence-parallel and the overlap that "
                              "--no-async-tensor-model-parallel-allreduce turns off; add the one, drop the other, "
                              "or drop --async-tensor-parallel.")
        if self.expert_tensor is not None and self.tensor % self.expert_tensor:
            raise ConfigError(f"--expert-tensor-parallel-size {self.expert_tensor} does not divide "
                              f"--tensor-model-parallel-size {self.tensor}: each group of that many tensor ranks "
                              "shares a tensor group's tokens between its experts; use a divisor of it.")
        check_comm_type(self.context_parallel_size, self.cp_comm_type, self.hierarchical_context_parallel_sizes)
        if self.pipedream_vertical_sync and not self._descriptor_has("vertical_sync"):
            raise ConfigError(f"--pipedream-vertical-sync has no meaning with --pipeline-schedule "
                              f"{self.pipeline_schedule}: it chooses the weight versions of PipeDream's weight "
                              f"stashing; drop the flag or use --pipeline-schedule {names_where('vertical_sync')}.")
        plan = self.stage_plan()
        if plan is None:
            return
        if self.expert > 1 and plan.equal_replication is None:
            raise ConfigError(f"--pipeline-stages {plan.to_text()} replicates its stages unequally, and 1F1B-RR's "
                              "replicas of a stage run different microbatches at different times, so an expert "
                              "group across them would wait on the others' all-to-alls; replicate every stage "
                              "equally or drop --expert-model-parallel-size.")
        if self.virtual_pipeline > 1:
            raise ConfigError("--pipeline-stages cannot be combined with virtual pipeline stages; drop "
                              "--num-layers-per-virtual-pipeline-stage or the plan.")
        if self.pipeline not in (1, plan.num_stages):
            raise ConfigError(f"--pipeline-stages names {plan.num_stages} stages but --pipeline-model-parallel-size "
                              f"is {self.pipeline}; drop --pipeline-model-parallel-size or make them equal.")
        if plan.equal_replication is None and not self._descriptor_has("unequal_replicas"):
            raise ConfigError(f"--pipeline-stages replicates its stages unequally ({plan.to_text()}), which only "
                              f"--pipeline-schedule {names_where('unequal_replicas')} (1F1B-RR) can run; use "
                              "it or replicate every stage equally.")
        if num_layers is not None:
            plan.validate(num_layers, world_size, self.tensor, self.context_parallel_size)

    def stage_plan(self) -> Optional["StagePlan"]:
        """The plan ``pipeline_stages`` names, or None."""
        return None if self.pipeline_stages is None else read_stage_plan(self.pipeline_stages)

    def layer_ranges(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """Every (virtual) stage's layers, in stage order: the plan's, or an equal split over p x v stages."""
        plan = self.stage_plan() or equal_split(num_layers, self.pipeline * self.virtual_pipeline)
        return tuple(plan.layer_ranges)


@dataclass
class DataConfig:
    """Where samples come from: ``data_path`` empty means the embedded default corpus."""

    data_path: list = flag(default_factory=list, nargs="*",
                           help="prefix, or weight/prefix pairs; the embedded corpus when omitted")
    split: Optional[str] = flag(None, help="train,valid,test weights over documents; default 969,30,1 (90,5,5 for "
                                           "the embedded corpus)")
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    data_cache_path: Optional[str] = None
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    # GPT: documents packed into one sample (megapipe/data/packing.py), as Megatron-LM
    eod_mask_loss: bool = flag(False, help="GPT: no loss where the input token is the end-of-document token")
    reset_position_ids: bool = flag(False, help="GPT: positions restart at 0 after each end-of-document token")
    reset_attention_mask: bool = flag(False, help="GPT: a token attends only to the tokens of its own document")
    # synthetic tokens (benchmarks), as Megatron's mock GPT dataset
    mock_data: bool = flag(False, help="GPT: synthetic random tokens instead of --data-path")
    vocab_size: Optional[int] = flag(None, help="vocabulary of --mock-data or --tokenizer-type NullTokenizer")
    # Hugging Face datasets tokenised while training reads them (megapipe/data/hf_stream.py)
    hf_dataset: Optional[str] = flag(None, metavar="PATH", help=(
        "GPT: a Hugging Face dataset saved with save_to_disk, or a folder of Parquet, JSONL or Arrow files, "
        "tokenised with the run's tokenizer as training reads it, instead of --data-path"))
    hf_dataset_text_key: str = flag("text", help="the column of --hf-dataset that holds the text")
    num_workers: int = flag(2, help="processes that tokenise --hf-dataset text ahead of training (0: the "
                                    "training process itself)")

    def __post_init__(self):
        # the embedded corpus has only a few thousand documents (79 for BERT): Megatron's 969,30,1
        # would leave its test split empty
        if self.split is None:
            self.split = "969,30,1" if self.data_path or self.hf_dataset else "90,5,5"


@dataclass
class TrainingConfig:
    """The loop: batch sizes, length, evaluation, checkpoints and logging."""

    micro_batch_size: int = 8
    global_batch_size: int = 32
    train_iters: int = 500
    eval_interval: int = 100
    eval_iters: int = 10
    log_interval: Optional[int] = flag(None, help=(
        "iterations between loss lines, the last iteration logging too; default a tenth of --train-iters, "
        "between 1 and Megatron-LM's 100"))
    seed: int = 1234
    save: Optional[str] = None
    load: Optional[str] = None
    use_checkpoint_args: bool = flag(False, help=(
        "take the model's shape from the --load checkpoint (a megapipe one: import a Megatron-LM checkpoint "
        "first); a shape flag given that differs is refused"))
    save_interval: Optional[int] = None
    local_checkpoint_interval: Optional[int] = flag(None, metavar="N", help=(
        "every N iterations keep each rank's training state in this host's memory (--local-checkpoint-dir) and "
        "a copy in the memory of a rank on the next host, written in the background; a run with --load resumes "
        "from these copies when they are newer than the disk checkpoint, without reading the disk; independent "
        "of --save-interval; default off"))
    local_checkpoint_dir: str = flag("/dev/shm/megapipe-local-checkpoints", metavar="DIR", help=(
        "with --local-checkpoint-interval: where this host keeps its own and its peer's copies (a memory-backed "
        "file system by default); one directory per job"))
    no_save_optim: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = flag(False, help="load weights only; start at iteration 0")
    async_save: bool = False
    exit_on_save_failure: bool = flag(True, action=BooleanOptionalAction, help=(
        "stop the run (exit 2) when a checkpoint save fails, e.g. on a full disk (on by default, as in Megatron-LM); "
        "--no-exit-on-save-failure warns and tries again at the next save (a run's last save has no next one: its "
        "failure stops the run either way)"))
    # save and exit at the next iteration boundary on SIGTERM (megapipe/training/exits.py)
    exit_on_sigterm: bool = flag(True, name="--exit-signal-handler", action=BooleanOptionalAction, help=(
        "on SIGTERM, save (with --save) and exit at the next iteration every rank agrees on (on by default; "
        "--no-exit-signal-handler leaves SIGTERM to Python's default)"))
    exit_signal_grace_seconds: Optional[float] = flag(None, help=(
        "seconds between SIGTERM and SIGKILL (Slurm's KillWait or GraceTime): the exit save is skipped, leaving "
        "the previous checkpoint, when the last save took longer than the time left"))
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    record_timeline: Optional[str] = flag(None, help=(
        "write when each pipeline action of every training iteration ran, per pipeline rank, to this JSON "
        "(tools/plot_schedule.py --timeline draws it); it grows with the iterations: meant for short runs"))
    # for model FLOPs utilisation; known GPUs are looked up
    device_peak_tflops: Optional[float] = flag(None, help=(
        "peak dense bf16 TFLOP/s of one device, for model FLOPs utilisation (known GPUs are looked up by name)"))
    fusion_backend: str = flag("auto", choices=("auto", "apex", "triton", "compile", "eager"), group=KERNELS)
    fp8_format: Optional[str] = flag(None, choices=("e4m3", "hybrid"), group=KERNELS, help=(
        "the transformer layers' linears in FP8 (GPUs of compute capability 8.9 and newer, with --bf16): E4M3 for "
        "inputs, weights and output gradients, or hybrid: E5M2 for the gradients; default off"))
    fp8_recipe: str = flag("tensorwise", choices=("tensorwise", "rowwise"), group=KERNELS, help=(
        "with --fp8-format: one scale per tensor, or one per row of the input and per output row of the weight"))
    # operations (megapipe/training/exits.py)
    distributed_timeout_minutes: float = flag(COLLECTIVE_TIMEOUT.total_seconds() / 60, help="how long a collective waits for a peer before failing")
    hang_watchdog_seconds: Optional[float] = flag(None, help=(
        "a rank that waits this long in one collective or for one pipeline message writes where every rank is "
        "to --hang-report and exits (status 3) with one sentence naming the collective and the rank it waits "
        "for; must be below --distributed-timeout-minutes; default off (0 too)"))
    hang_report: str = flag("hang_report.json", metavar="PATH", help=(
        "where the hang watchdog writes every rank's state: its collective, group, pipeline action and stack"))
    straggler_check_interval: Optional[int] = flag(None, metavar="K", help=(
        "every K iterations compare each rank's compute and communication time per step with the other ranks "
        "of its pipeline stage and name one slower by more than --straggler-threshold (rank, host, phase) in "
        "the log and the cluster scheduler's status; default off"))
    straggler_threshold: float = flag(0.2, help="with --straggler-check-interval: how much slower than its "
                                                "peers' median a rank must be to be named (0.2: 20%%)")
    # fault-tolerant replicas (megapipe/replicas/)
    fault_tolerant_replicas: Optional[int] = flag(None, metavar="N", help=(
        "train as one of N data-parallel replicas, each its own torchrun job (t x c x p x e x d ranks), that agree "
        "on a quorum with --lighthouse before every step: a lost replica's step is discarded and the survivors go "
        "on at the same global batch without a restart; a replica started later (the same command) receives the "
        "state from a live one and joins; default off"))
    replica_id: Optional[int] = flag(None, metavar="K", help="with --fault-tolerant-replicas: this replica's number, "
                                                             "0 to N-1")
    lighthouse: Optional[str] = flag(None, metavar="HOST:PORT", help=(
        "with --fault-tolerant-replicas: the lighthouse that decides each step's quorum "
        "(python -m megapipe.replicas.lighthouse)"))
    replica_timeout_seconds: float = flag(60.0, help=(
        "with --fault-tolerant-replicas: how long a collective between replicas waits for a peer before the step "
        "is discarded"))
    exit_interval: Optional[int] = flag(None, help="save (with --save) and exit every N iterations")
    exit_duration_in_mins: Optional[float] = flag(None, help="save (with --save) and exit once training has run "
                                                             "this long")
    skip_train: bool = flag(False, help="evaluate the --load checkpoint on the validation and test sets without "
                                        "training")
    override_opt_param_scheduler: bool = flag(False, help="on resume, take the learning-rate schedule from the "
                                                          "flags, not the checkpoint")
    use_checkpoint_opt_param_scheduler: bool = flag(False, help="on resume, take the learning-rate schedule from "
                                                                "the checkpoint, not the flags")
    # NaN/Inf in the loss or gradients (megapipe/training/non_finite.py)
    check_for_nan_in_loss_and_grad: bool = flag(False, help=(
        "watch every iteration's loss and gradient norm for NaN/Inf (on the device; read at each log and save); "
        "the update of such an iteration is skipped on every rank, and --non-finite-action says what follows"))
    non_finite_action: str = flag("stop", choices=("stop", "skip"), help=(
        "with --check-for-nan-in-loss-and-grad: stop (Megatron-LM's behaviour: exit 2 with one sentence naming "
        "the iteration and the rank, before any later checkpoint) or skip (log the same and keep training)"))
    # scheduler address of this job's lease (megapipe/lease/client.py)
    cluster_lease: Optional[str] = flag(None, metavar="ADDRESS", help=(
        "run under a lease of the cluster scheduler at this http:// address: report progress, renew before the "
        "lease ends, else save and exit (set by tools/cluster.py)"))

    def __post_init__(self):
        if self.log_interval is None:  # a few lines in any run: 4 iterations log each, long runs every 100
            self.log_interval = min(100, max(1, self.train_iters // 10))

    @property
    def hang_watchdog(self) -> Optional[float]:
        """Seconds a rank may wait in one collective before the hang watchdog reports; None when off."""
        return self.hang_watchdog_seconds or None

    @property
    def collective_timeout(self) -> datetime.timedelta:
        """``--distributed-timeout-minutes``: how long every collective of the run waits for a peer."""
        return datetime.timedelta(minutes=self.distributed_timeout_minutes)

    def logs_after(self, iteration: int) -> bool:
        """Whether the loss line is printed after ``iteration``: every --log-interval, and at the end, so
        that every run prints one."""
        return iteration % self.log_interval == 0 or iteration == self.train_iters

    def num_microbatches(self, data_parallel: int) -> int:
        """m = global batch / (micro batch x d), as in Megatron."""
        per_step = self.micro_batch_size * data_parallel
        if self.global_batch_size % per_step:
            raise ConfigError(f"--global-batch-size {self.global_batch_size} is not divisible by --micro-batch-size "
                              f"{self.micro_batch_size} x data-parallel size {data_parallel} (= {per_step}); "
                              f"use a multiple of {per_step}.")
        return self.global_batch_size // per_step


@dataclass
class Config:
    """Everything a run needs, parsed once from the flags."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
