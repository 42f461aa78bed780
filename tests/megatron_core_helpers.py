"""Megatron-core itself on the CPU, for the Megatron checkpoint tests: tiny ``GPTModel``s with the local
layer spec, their logits, real ``dist_checkpointing`` saves and loads, and legacy ``torch`` checkpoints
split over (t, p) ranks as Megatron's tensor and pipeline parallelism split them.

Megatron-core asks CUDA for its current device and to synchronise, and its torch_dist writer measures
its memory with psutil and starts helper processes (which a daemonic world rank may not have), and
its MoE router reads a Transformer Engine GEMM that is unbound without it;
``megatron_core_on_cpu`` stubs those for the caller's block only.
Dropout is zero and the RNG tracker is the inference one (no CUDA generator states).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os

import pytest
import torch

SEQ, BATCH, VOCAB = 12, 3, 128

# Megatron-LM arguments of each variant; TransformerConfig and GPTModel options follow from them
VARIANTS = {
    # Megatron-LM's default bias-GeLU fusion: its (tanh-approximated) kernel
    "gpt": dict(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, normalization="LayerNorm",
                swiglu=False, add_bias_linear=True, position_embedding_type="learned_absolute",
                untie_embeddings_and_output_weights=False, group_query_attention=False, num_query_groups=None,
                rotary_base=10000, bias_gelu_fusion=True, add_qkv_bias=False),
    "llama": dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, normalization="RMSNorm",
                  swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                  untie_embeddings_and_output_weights=True, group_query_attention=True, num_query_groups=2,
                  rotary_base=500000, bias_gelu_fusion=False, add_qkv_bias=False),
}
VARIANTS["qwen"] = dict(VARIANTS["llama"], add_qkv_bias=True)  # a bias on q, k and v alone
# per-head QK layernorm and MoE layers (4 experts, top-2, a gated shared expert)
VARIANTS["moe"] = dict(VARIANTS["llama"], qk_layernorm=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                       moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
# DeepSeek-V3's routing: sigmoid scores, an expert bias (a buffer) that chooses experts, no shared expert
VARIANTS["moe-bias"] = dict(VARIANTS["llama"], num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
# dense and MoE layers mixed (--moe-layer-freq): layer 0 dense, layer 1 MoE with a shared expert; Megatron-core keeps
# such models' layers under one torch_dist key each instead of stacking them
VARIANTS["moe-mixed"] = dict(VARIANTS["llama"], num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                             moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1])
EXPORTED = sorted(VARIANTS)
# Megatron-LM argument -> TransformerConfig field, for the MoE variant's options
_MOE_CONFIG = {"qk_layernorm": "qk_layernorm", "num_experts": "num_moe_experts", "moe_router_topk": "moe_router_topk",
               "moe_ffn_hidden_size": "moe_ffn_hidden_size",
               "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
               "moe_shared_expert_gate": "moe_shared_expert_gate",
               "moe_router_score_function": "moe_router_score_function",
               "moe_router_enable_expert_bias": "moe_router_enable_expert_bias", "moe_layer_freq": "moe_layer_freq"}


def megatron_args(variant: str) -> argparse.Namespace:
    """The arguments Megatron-LM's training loop would store for ``variant``."""
    return argparse.Namespace(**{**dict(max_position_embeddings=SEQ, seq_length=SEQ, padded_vocab_size=VOCAB,
                                        make_vocab_size_divisible_by=128, norm_epsilon=1e-5, kv_channels=None,
                                        rotary_percent=1.0, num_experts=None, hidden_dropout=0.0,
                                        attention_dropout=0.0),
                                 **VARIANTS[variant]})


@contextlib.contextmanager
def megatron_core_on_cpu():
    """Megatron-core's parallel state for one CPU rank (torch.distributed must be up), with its CUDA calls stubbed."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.moe import moe_utils

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        patch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        patch.setattr(filesystem_async, "_process_memory", lambda: 0)
        patch.setitem(multiprocessing.current_process()._config, "daemon", False)
        patch.setattr(moe_utils, "te_general_gemm", None, raising=False)  # unbound without Transformer Engine
        parallel_state.initialize_model_parallel(1, 1)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def build(variant: str, seed: int):
    """A Megatron-core GPTModel of ``variant`` with non-trivial norms and biases (so a swapped mapping shows) and
    weights large enough that every non-linearity bends."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    v = VARIANTS[variant]
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=v["num_layers"], hidden_size=v["hidden_size"], ffn_hidden_size=v["ffn_hidden_size"],
        num_attention_heads=v["num_attention_heads"], num_query_groups=v["num_query_groups"],
        normalization=v["normalization"], gated_linear_unit=v["swiglu"],
        activation_func=torch.nn.functional.silu if v["swiglu"] else torch.nn.functional.gelu,
        add_bias_linear=v["add_bias_linear"], add_qkv_bias=v["add_qkv_bias"],
        bias_activation_fusion=v["bias_gelu_fusion"], hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32,
        moe_token_dispatcher_type="allgather",  # the all-to-all one makes a CUDA stream
        **{field: v[arg] for arg, field in _MOE_CONFIG.items() if arg in v})
    if "moe_layer_freq" in v:  # each layer's own spec, dense or MoE
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=v["normalization"])
    else:
        spec = get_gpt_layer_local_spec(normalization=v["normalization"], num_experts=v.get("num_experts"),
                                        qk_layernorm=v.get("qk_layernorm", False))
    model = GPTModel(config, spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type=v["position_embedding_type"],
                     rotary_base=v["rotary_base"],
                     share_embeddings_and_output_weights=not v["untie_embeddings_and_output_weights"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:  # activations of order one, where exact and tanh-approximated GeLU differ
                p.normal_(0.0, 0.3)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):  # large enough to change which experts tokens choose
                buffer.normal_(0.0, 0.3)
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Megatron-core's logits [batch, seq, vocab] (causal mask given: its default one is made on CUDA)."""
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    positions = torch.arange(SEQ).expand(ids.shape[0], SEQ)
    with torch.no_grad():
        return model(ids, positions, attention_mask=mask)


def save_dist(model, args, root: str, iteration: int = 10) -> None:
    """Save as Megatron-LM does with --ckpt-format torch_dist (the model part of its state)."""
    from megatron.core import dist_checkpointing

    directory = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(directory)
    state = {"model": model.sharded_state_dict(), "args": args, "iteration": iteration, "checkpoint_version": 3.0}
    dist_checkpointing.save(state, directory)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def load_dist(model, directory: str) -> None:
    """Load a torch_dist checkpoint into ``model`` with Megatron-core's own loader, as Megatron-LM does; returns
    the rest of the state (``args``, ``iteration`` ... from common.pt)."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, directory)
    model.load_state_dict(state.pop("model"), strict=True)
    return state


def _split(name: str, value, t: int, swiglu: bool) -> list:
    """``value``'s slices over ``t`` tensor ranks, as Megatron's column/row-parallel layers hold them."""
    if value is None or t == 1:
        return [value] * t
    if swiglu and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):  # each rank: [its gate rows; its up rows]
        gate, up = value.chunk(2, dim=0)
        return [torch.cat(pair) for pair in zip(gate.chunk(t), up.chunk(t))]
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias",
                      "linear_fc1.weight", "linear_fc1.bias")):
        return [part.clone() for part in value.chunk(t, dim=0)]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return [part.clone() for part in value.chunk(t, dim=1)]
    return [value] * t


def save_legacy(model, args, root: str, t: int, p: int, iteration: int = 10) -> None:
    """Save as Megatron-LM's legacy torch format would from a (t, p) run: one model_optim_rng.pt per rank."""
    state = model.state_dict()
    per_stage = args.num_layers // p
    directory = os.path.join(root, f"iter_{iteration:07d}")
    for stage in range(p):
        part = {}
        for name, value in state.items():
            if name.startswith("embedding.") and stage > 0:
                continue
            if name.startswith(("decoder.final_layernorm", "output_layer")) and stage < p - 1:
                continue
            if name.startswith("decoder.layers."):
                layer, rest = name.removeprefix("decoder.layers.").split(".", 1)
                if int(layer) // per_stage != stage:
                    continue
                name = f"decoder.layers.{int(layer) - stage * per_stage}.{rest}"
            part[name] = value
        if p > 1 and stage == p - 1 and not args.untie_embeddings_and_output_weights:
            part["output_layer.weight"] = state["embedding.word_embeddings.weight"]  # the last stage's copy
        for rank in range(t):
            rank_dir = os.path.join(directory, f"mp_rank_{rank:02d}" + (f"_{stage:03d}" if p > 1 else ""))
            os.makedirs(rank_dir)
            model_part = {name: _split(name, value, t, args.swiglu)[rank] for name, value in part.items()}
            torch.save({"model": model_part, "args": args, "iteration": iteration, "checkpoint_version": 3.0,
                        "optimizer": {"state": {}, "param_groups": []}},
                       os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
