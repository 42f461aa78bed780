"""megatron-core's GPTModel trained the way Megatron-LM trains it, for the single-device benchmark:
its fastest layer spec available (Transformer Engine's where transformer_engine imports, else the
local one), Float16Module (bf16 weights), megatron-core's DistributedDataParallel (fp32
main-gradient buffer) and its mixed-precision optimizer (fp32 masters, AdamW).

Only the building is here; ``bench_single_device.py`` times the returned step function. On a
machine where megatron-core cannot run (no CUDA: its RNG tracker and tensor-parallel layers call
``torch.cuda``), building raises and the benchmark prints the reason instead of a time.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from typing import Callable

import torch
import torch.nn.functional as F


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _import_mcore():
    """The megatron-core modules used below; raises ImportError when megatron-core is absent."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" fallbacks
        logging.getLogger("megatron").setLevel(logging.ERROR)
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig
    return (parallel_state, tensor_parallel, DistributedDataParallel, DistributedDataParallelConfig, GPTModel,
            gpt_layer_specs, OptimizerConfig, get_megatron_optimizer, Float16Module, TransformerConfig)


def fastest_spec(gpt_layer_specs) -> tuple[object, str]:
    """(layer spec, its name): Transformer Engine's fused layers when they import, else the local spec."""
    if _has_module("transformer_engine"):
        try:
            return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(), "Transformer Engine spec"
        except (ImportError, AssertionError):  # an engine build that megatron-core refuses
            pass
    return gpt_layer_specs.get_gpt_layer_local_spec(), "local spec"


def mcore_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed, or no metadata
        return None


def fused_kernels() -> dict[str, bool]:
    """Which of megatron-core's optional CUDA kernels can be imported (from apex or Megatron-LM's builds)."""
    return {"masked_softmax_fusion": _has_module("scaled_upper_triang_masked_softmax_cuda"),
            "gradient_accumulation_fusion": _has_module("fused_weight_gradient_mlp_cuda")}


def build_mcore_gpt(num_layers: int, hidden_size: int, heads: int, seq_length: int, padded_vocab_size: int,
                    dropout: float, lr: float, weight_decay: float, clip_grad: float,
                    device: torch.device) -> tuple[Callable[[dict, int], torch.Tensor], Callable[[], None],
                                                   Callable[[], None], str]:
    """(forward_backward(batch, micro_batches) -> loss, optimizer_step(), teardown(), description) for
    megatron-core's GPT on ``device``; gradients accumulate in its buffer until the optimizer step.

    ``batch`` holds ``tokens``, ``labels`` and ``loss_mask`` ([b, s]) as for megapipe. Raises
    whatever megatron-core raises when it cannot run here; torch.distributed (a world of one) and
    megatron-core's parallel state are torn down again in that case.
    """
    (parallel_state, tensor_parallel, DistributedDataParallel, DistributedDataParallelConfig, GPTModel,
     gpt_layer_specs, OptimizerConfig, get_megatron_optimizer, Float16Module, TransformerConfig) = _import_mcore()
    from megapipe.parallel.launch import init_distributed

    import torch.distributed as dist

    started_dist = not dist.is_initialized()
    init_distributed(device=device)

    def teardown() -> None:
        parallel_state.destroy_model_parallel()
        if started_dist and dist.is_initialized():
            dist.destroy_process_group()

    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        kernels = fused_kernels()
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=heads,
            ffn_hidden_size=4 * hidden_size, hidden_dropout=dropout, attention_dropout=dropout,
            init_method_std=0.02, layernorm_epsilon=1e-5, activation_func=F.gelu,
            bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
            use_cpu_initialization=device.type != "cuda",
            bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=False, persist_layer_norm=False,
            masked_softmax_fusion=kernels["masked_softmax_fusion"],
            gradient_accumulation_fusion=kernels["gradient_accumulation_fusion"])
        spec, spec_name = fastest_spec(gpt_layer_specs)
        model = GPTModel(config=config, transformer_layer_spec=spec,
                         vocab_size=padded_vocab_size, max_sequence_length=seq_length, pre_process=True,
                         post_process=True, share_embeddings_and_output_weights=True,
                         position_embedding_type="learned_absolute")
        model = Float16Module(config, model.to(device))
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, bf16=True,
                            params_dtype=torch.bfloat16, clip_grad=clip_grad, use_distributed_optimizer=False),
            [model])
    except BaseException:
        teardown()
        raise

    position_ids = {}

    def forward_backward(batch: dict, micro_batches: int) -> torch.Tensor:
        tokens = batch["tokens"]
        if tokens.shape not in position_ids:
            position_ids[tokens.shape] = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        # attention_mask None: the local spec's causal softmax builds the causal mask itself
        per_token = model(tokens, position_ids[tokens.shape], None, labels=batch["labels"])
        mask = batch["loss_mask"].float()
        loss = (per_token.float() * mask).sum() / mask.sum()
        (loss / micro_batches).backward()
        return loss.detach()

    def optimizer_step() -> None:
        model.finish_grad_sync()
        optimizer.step()
        model.zero_grad_buffer()
        optimizer.zero_grad()

    fused = ", ".join(name for name, ok in kernels.items() if ok) or "no apex kernels"
    return (forward_backward, optimizer_step, teardown,
            f"{spec_name}, bf16 Float16Module + DDP + AdamW, fp32 masters ({fused})")
