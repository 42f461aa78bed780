"""Per-layer routing statistics for the log line, TensorBoard and W&B (Megatron-LM logs the same per MoE layer).

Each router sums on the device, over the microbatches since the last log line: tokens per expert,
dropped assignments, and its balancing and z losses. ``moe_layer_stats`` reads and clears them (the
one host synchronisation, at the log interval): per layer, tokens per expert per microbatch
(min/mean/max), their coefficient of variation, dropped assignments per microbatch and the mean
losses. ``moe_stats_text`` writes one compact field per layer, ``moe L3 tok 12/20/31 cv 0.25 drop 4
aux 1.02 z 3.1``; ``moe_stats_scalars`` names them for TensorBoard and W&B (``moe-L3-cv`` ...).
"""

from __future__ import annotations

import torch

from megapipe.models.moe.router import TopKRouter


def layer_stats(log_sums: torch.Tensor) -> dict:
    """The statistics of one router's ``log_sums`` (per-expert tokens, dropped, aux, z, microbatches)."""
    values = log_sums.tolist()
    experts, (dropped, aux, z, batches) = values[:-4], values[-4:]
    batches = max(batches, 1.0)
    per_batch = torch.tensor(experts) / batches
    mean = per_batch.mean().item()
    cv = per_batch.std(unbiased=False).item() / mean if mean > 0 else 0.0
    return dict(min=per_batch.min().item(), mean=mean, max=per_batch.max().item(), cv=cv, dropped=dropped / batches,
                aux=aux / batches, z=z / batches)


def moe_layer_stats(chunks) -> dict[int, dict]:
    """Global layer index -> ``layer_stats`` for every MoE layer of ``chunks`` that routed since the last call,
    clearing the sums."""
    out = {}
    for chunk in chunks:
        for name, router in chunk.named_modules():
            if isinstance(router, TopKRouter) and router.log_sums[-1].item() > 0:
                out[int(name.split(".")[1])] = layer_stats(router.log_sums)  # "layers.{i}.mlp.router"
                router.log_sums.zero_()
    return out


def moe_stats_text(stats: dict[int, dict]) -> str:
    return " | ".join(f"moe L{layer} tok {s['min']:.0f}/{s['mean']:.0f}/{s['max']:.0f} cv {s['cv']:.2f} "
                      f"drop {s['dropped']:.0f} aux {s['aux']:.3g} z {s['z']:.3g}"
                      for layer, s in sorted(stats.items()))


def moe_stats_scalars(stats: dict[int, dict]) -> dict[str, float]:
    return {f"moe-L{layer}-{key}": value for layer, s in stats.items() for key, value in s.items()}
