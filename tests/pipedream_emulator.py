"""A sequential emulator of the asynchronous update rules of seed 002 Table 7.1.

One process, the whole model as one module, no schedule, no executor, no weight store: the
reference the pipelined PipeDream and 2BW runs must equal. The model's parameters are split
into stages by layer range; stage s keeps the history of its weight versions (version k =
its weights after k updates) and its own optimizer. Microbatches are processed in order;
microbatch k's loss is computed with stage s's weights taken from version ``version(s, k)``
(``torch.func.functional_call`` over the whole model), its gradient with respect to each
stage's weights joins that stage's update ``group(s, k)``, and when a group is complete its
mean gradient is applied to the stage's newest weights, making the next version.

Rules, for p stages (s 0-indexed), microbatch k (0-indexed) and m microbatches per batch:

* weight stashing:  version(s, k) = max(k - (p - 1 - s), 0),  group(s, k) = k
  i.e. W(t+1) = W(t) - lr grad f(W_1(t-p+1), ..., W_p(t));
* vertical sync:    version(s, k) = max(k - (p - 1), 0),       group(s, k) = k;
* 2BW:              version(s, k) = max(floor(k / m) - 1, 0),  group(s, k) = floor(k / m)
  i.e. W(t+1) = W(t) - lr grad f(W(t-1)) with batches of m microbatches.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.func import functional_call

Rule = Callable[[int, int], int]  # (stage, microbatch) -> version or update group


def stage_of_parameter(name: str, partition: list[tuple[int, int]]) -> int:
    """The stage holding a whole-model parameter: layers by range, embedding first, heads last."""
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(s for s, (start, end) in enumerate(partition) if start <= layer < end)
    return 0 if name.startswith("embedding.") else len(partition) - 1


def stashing(p: int) -> tuple[Rule, Rule]:
    return (lambda s, k: max(k - (p - 1 - s), 0)), (lambda s, k: k)


def vertical_sync(p: int) -> tuple[Rule, Rule]:
    return (lambda s, k: max(k - (p - 1), 0)), (lambda s, k: k)


def two_bw(m: int) -> tuple[Rule, Rule]:
    return (lambda s, k: max(k // m - 1, 0)), (lambda s, k: k // m)


def emulate(model: torch.nn.Module, partition: list[tuple[int, int]], rules: tuple[Rule, Rule],
            microbatches: list[dict], make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
    """Train ``model``'s weights (left untouched) on ``microbatches`` under ``rules``.

    Returns (per-microbatch losses, final whole-model weights by name, per-stage version
    histories). Every update group must be complete by the last microbatch.
    """
    version, group = rules
    stages = len(partition)
    names = [[n for n, _ in model.named_parameters() if stage_of_parameter(n, partition) == s] for s in range(stages)]
    live = [{n: torch.nn.Parameter(dict(model.named_parameters())[n].detach().clone()) for n in names[s]}
            for s in range(stages)]
    optimizers = [make_optimizer(list(live[s].values())) for s in range(stages)]
    history = [[{n: p.detach().clone() for n, p in live[s].items()}] for s in range(stages)]
    sums = [{} for _ in range(stages)]  # group -> (count, gradient sums)
    losses = []
    last_of_group = [{group(s, k): k for k in range(len(microbatches))} for s in range(stages)]
    for k, batch in enumerate(microbatches):
        leaves = {n: history[s][version(s, k)][n].clone().requires_grad_(True)
                  for s in range(stages) for n in names[s]}
        loss = functional_call(model, leaves, (None, batch))
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        losses.append(loss.item())
        for s in range(stages):
            count, total = sums[s].get(group(s, k), (0, None))
            step = [grads[n] for n in names[s]]
            sums[s][group(s, k)] = (count + 1, step if total is None else [a + b for a, b in zip(total, step)])
            if last_of_group[s][group(s, k)] == k:
                count, total = sums[s].pop(group(s, k))
                for param, summed in zip(live[s].values(), total):
                    param.grad = summed / count
                optimizers[s].step()
                history[s].append({n: p.detach().clone() for n, p in live[s].items()})
    final = {n: p.detach() for s in range(stages) for n, p in live[s].items()}
    return losses, final, history
