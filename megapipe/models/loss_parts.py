"""A loss and its named components, so a last stage can report more than the sum it trains on.

BERT trains on masked-LM loss + sentence-order loss but logs each (Megatron's ``lm loss`` and
``sop loss``): its head returns the sum with the parts attached (``with_parts``), and the
pipeline executor reads them (``parts_of``) next to the loss. A plain loss has no parts and
is logged under one name, ``LM_LOSS``. Each family's registry entry names the losses it logs.
"""

from __future__ import annotations

import torch

_ATTRIBUTE = "megapipe_loss_parts"
LM_LOSS = "lm loss"  # the language-model loss, as the log and TensorBoard name it (Megatron's name)


def lm_loss_only(config) -> tuple[str, ...]:
    """The losses a language model logs: its one loss."""
    return (LM_LOSS,)


def with_parts(loss: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """``loss`` (returned as is) carrying detached copies of its components, by name."""
    setattr(loss, _ATTRIBUTE, {name: value.detach() for name, value in parts.items()})
    return loss


def parts_of(loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """The components ``with_parts`` attached; empty for a plain loss."""
    return getattr(loss, _ATTRIBUTE, {})
