"""Per-layer routing statistics for the log line (Megatron-LM logs the same per MoE layer).

Each router sums on the device, over the microbatches since the last log line: tokens per expert,
dropped assignments, and its balancing and z losses. ``moe_log_summary`` reads and clears them
(the one host synchronisation, at the log interval) and writes one compact field per layer:
``moe L3 tok 12/20/31 cv 0.25 drop 4 aux 1.02 z 3.1`` (tokens per expert min/mean/max per
microbatch, their coefficient of variation, dropped assignments, mean losses).
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


def moe_log_summary(chunks) -> str:
    """One field per MoE layer of ``chunks`` (empty without MoE layers or microbatches), clearing the sums."""
    fields = []
    for chunk in chunks:
        for name, router in chunk.named_modules():
            if not isinstance(router, TopKRouter) or router.log_sums[-1].item() == 0:
                continue
            s = layer_stats(router.log_sums)
            router.log_sums.zero_()
            layer = name.split(".")[1] if name.startswith("layers.") else name
            fields.append(f"moe L{layer} tok {s['min']:.0f}/{s['mean']:.0f}/{s['max']:.0f} cv {s['cv']:.2f} "
                          f"drop {s['dropped']:.0f} aux {s['aux']:.3g} z {s['z']:.3g}")
    return " | ".join(fields)
