"""Mixture-of-experts options of ``ModelConfig``: which layers hold experts, and the checks of the MoE flags.

The fields themselves live in ``ModelConfig`` under Megatron-LM's names (``num_experts``,
``moe_router_topk`` ...), as in Megatron's ``TransformerConfig``; this module keeps what is
computed from them, so ``schema.py`` stays a list of fields.
"""

from __future__ import annotations

import argparse
from typing import Union

from megapipe.errors import ConfigError

LayerFreq = Union[int, tuple]


def layer_freq(text: str) -> LayerFreq:
    """``--moe-layer-freq``: N (every N-th layer from layer 0 holds experts) or a 0/1 list per layer,
    written ``1,0,1,1`` or ``[1,0,1,1]``."""
    text = text.strip().strip("[]")
    try:
        parts = [int(part) for part in text.split(",")]
    except ValueError:  # argparse names the flag
        raise argparse.ArgumentTypeError(f"{text} is neither a number nor a comma-separated 0/1 list; write e.g. 2 "
                                         "or 1,0,1,0") from None
    return parts[0] if len(parts) == 1 else tuple(parts)


def moe_layer_pattern(freq: LayerFreq, num_layers: int) -> tuple[bool, ...]:
    """Whether each layer's MLP is a mixture of experts (Megatron's reading of ``--moe-layer-freq``)."""
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(num_layers))
    return tuple(bool(x) for x in freq)


def check_layer_freq(freq: LayerFreq, num_layers: int) -> None:
    """``--moe-layer-freq`` is at least 1, or one 0 or 1 per layer."""
    if isinstance(freq, int) and freq < 1:
        raise ConfigError(f"--moe-layer-freq {freq} must be at least 1.")
    if not isinstance(freq, int) and (len(freq) != num_layers or set(freq) - {0, 1}):
        raise ConfigError(f"--moe-layer-freq lists {len(freq)} entries but --num-layers is {num_layers}; "
                          "give one 0 or 1 per layer.")


def validate_moe(config, tensor_parallel: int, expert_parallel: int = 1) -> None:
    """The MoE flags of ``config`` (a ModelConfig with ``num_experts`` set), each problem one sentence."""
    e, k = config.num_experts, config.moe_router_topk
    if e < 1:
        raise ConfigError(f"--num-experts {e} must be at least 1 (leave it out for a dense MLP).")
    if e % expert_parallel:
        raise ConfigError(f"--num-experts {e} is not divisible by --expert-model-parallel-size {expert_parallel}; "
                          "every expert rank must hold the same number of experts.")
    if not 1 <= k <= e:
        raise ConfigError(f"--moe-router-topk {k} must be between 1 and --num-experts {e}; each token picks "
                          "that many distinct experts.")
    if config.add_bias_linear:
        raise ConfigError("--num-experts needs --disable-bias-linear: megapipe's experts have no biases.")
    if config.moe_router_score_function not in ("softmax", "sigmoid"):
        raise ConfigError(f"--moe-router-score-function {config.moe_router_score_function} is unknown; use softmax "
                          "or sigmoid.")
    _validate_groups(config, e, k)
    if config.moe_router_pre_softmax and config.moe_router_score_function != "softmax":
        raise ConfigError("--moe-router-pre-softmax applies to --moe-router-score-function softmax only; drop it.")
    if config.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss", "none"):
        raise ConfigError(f"--moe-router-load-balancing-type {config.moe_router_load_balancing_type} is unknown; "
                          "use aux_loss, seq_aux_loss or none.")
    for flag, value in (("--moe-aux-loss-coeff", config.moe_aux_loss_coeff),
                        ("--moe-z-loss-coeff", config.moe_z_loss_coeff or 0.0),
                        ("--moe-router-bias-update-rate", config.moe_router_bias_update_rate)):
        if value < 0:
            raise ConfigError(f"{flag} {value} must not be negative.")
    _validate_capacity(config)
    for flag, value in (("--moe-ffn-hidden-size", config.moe_ffn_hidden_size),
                        ("--moe-shared-expert-intermediate-size", config.moe_shared_expert_intermediate_size)):
        if value is not None and (value < 1 or value % tensor_parallel):
            raise ConfigError(f"{flag} {value} must be a positive multiple of --tensor-model-parallel-size "
                              f"{tensor_parallel}.")
    if config.moe_shared_expert_gate and config.moe_shared_expert_intermediate_size is None:
        raise ConfigError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size (the shared expert "
                          "it gates).")
    check_layer_freq(config.moe_layer_freq, config.num_layers)
    if config.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        raise ConfigError(f"--moe-token-dispatcher-type {config.moe_token_dispatcher_type} is unknown; use "
                          "allgather or alltoall.")


def _validate_groups(config, e: int, k: int) -> None:
    groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
    if group_topk is not None and groups is None:
        raise ConfigError("--moe-router-group-topk needs --moe-router-num-groups (how many groups the experts form); "
                          "add it or drop the group top-k.")
    if groups is None:
        return
    if groups < 1 or e % groups:
        raise ConfigError(f"--moe-router-num-groups {groups} does not divide --num-experts {e}; every group must "
                          "hold the same number of experts.")
    if group_topk is None:
        raise ConfigError("--moe-router-num-groups needs --moe-router-group-topk (how many groups each token may "
                          "use).")
    if not 1 <= group_topk <= groups or k % group_topk or k // group_topk > e // groups:
        raise ConfigError(f"--moe-router-group-topk {group_topk} must be between 1 and --moe-router-num-groups "
                          f"{groups} and divide --moe-router-topk {k} into at most {e // groups} experts per group.")


def _validate_capacity(config) -> None:
    factor = config.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        raise ConfigError(f"--moe-expert-capacity-factor {factor} must be above 0 (1.0 lets each expert take its "
                          "even share of tokens); leave it out to drop no token.")
    if config.moe_token_drop_policy not in ("probs", "position"):
        raise ConfigError(f"--moe-token-drop-policy {config.moe_token_drop_policy} is unknown; use probs or "
                          "position.")
    if config.moe_pad_expert_input_to_capacity and factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the capacity to "
                          "pad to).")
    if config.moe_dropless_device_dispatch:
        _validate_dropless(config, factor)


def _validate_dropless(config, factor) -> None:
    """--moe-dropless-device-dispatch: drop-free by construction, on the alltoall dispatcher's grouped product."""
    e, k = config.num_experts, config.moe_router_topk
    if factor is not None and factor * k < e:
        raise ConfigError(f"--moe-expert-capacity-factor {factor} lets an expert keep only {factor * k / e:.3g} of "
                          f"a micro-batch's tokens, so it drops tokens, but --moe-dropless-device-dispatch asks for "
                          f"none dropped; leave the factor out, or raise it to at least {e / k:g} (--num-experts / "
                          "--moe-router-topk).")
    if config.moe_pad_expert_input_to_capacity:
        raise ConfigError("--moe-dropless-device-dispatch and --moe-pad-expert-input-to-capacity are two ways to "
                          "fix the all-to-all's sizes on the device; keep one.")
    if config.moe_token_dispatcher_type != "alltoall":
        raise ConfigError("--moe-dropless-device-dispatch shapes the alltoall dispatcher's exchange; drop "
                          f"--moe-token-dispatcher-type {config.moe_token_dispatcher_type} or the flag.")
    if not config.moe_grouped_gemm:
        raise ConfigError("--moe-dropless-device-dispatch needs --moe-grouped-gemm (the loop over experts would "
                          "read their token counts on the host); add it.")
