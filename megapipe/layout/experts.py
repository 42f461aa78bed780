"""How the experts' groups are carved out of one pipeline stage's ranks (Megatron-core's MoE folding).

Per pipeline stage, the t x c x d ranks that the dense layers use (tensor-innermost) are numbered
again as ``local = et + etp * (ep + e * edp)``: expert-tensor index innermost, then expert, then
expert-data. So ``etp x e`` must divide ``t x c x d``; with ``etp = t`` (the default, as Megatron's)
that is ``e`` dividing ``c x d``: the expert ranks are data-parallel replicas of the dense layers.
Pure arithmetic over a stage's first rank and its size, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.errors import ConfigError


@dataclass(frozen=True)
class ExpertFold:
    """The expert-tensor (etp), expert (e) and expert-data (edp) degrees of a stage of ``stage_ranks`` ranks."""

    expert_tensor: int
    expert: int
    stage_ranks: int

    @staticmethod
    def checked(expert: int, expert_tensor: int, tensor: int, data: int, context: int = 1) -> "ExpertFold":
        """The fold for these degrees, or one sentence naming the flags that do not fit."""
        for flag, value in (("--expert-model-parallel-size", expert), ("--expert-tensor-parallel-size", expert_tensor)):
            if value < 1:
                raise ConfigError(f"{flag} {value} must be at least 1.")
        stage = tensor * context * data
        if stage % (expert_tensor * expert):
            raise ConfigError(
                f"--expert-model-parallel-size {expert} x --expert-tensor-parallel-size {expert_tensor} does not "
                f"divide the {stage} ranks of a pipeline stage (--tensor-model-parallel-size {tensor} x "
                f"--context-parallel-size {context} x data-parallel {data}); experts are carved out of those ranks, "
                "so launch more data-parallel replicas or lower the expert sizes.")
        return ExpertFold(expert_tensor, expert, stage)

    @property
    def expert_data(self) -> int:
        return self.stage_ranks // (self.expert_tensor * self.expert)

    def _local(self, et: int, ep: int, edp: int) -> int:
        return et + self.expert_tensor * (ep + self.expert * edp)

    def expert_groups(self, first: int) -> list[list[int]]:
        """The ranks that split the experts between them, for the stage whose first rank is ``first``."""
        return [[first + self._local(et, ep, edp) for ep in range(self.expert)]
                for edp in range(self.expert_data) for et in range(self.expert_tensor)]

    def expert_tensor_groups(self, first: int) -> list[list[int]]:
        """The ranks that split each expert's ffn dimension."""
        return [[first + self._local(et, ep, edp) for et in range(self.expert_tensor)]
                for edp in range(self.expert_data) for ep in range(self.expert)]

    def expert_data_groups(self, first: int) -> list[list[int]]:
        """The ranks holding the same experts' slice: expert gradients are reduced over them."""
        return [[first + self._local(et, ep, edp) for edp in range(self.expert_data)]
                for ep in range(self.expert) for et in range(self.expert_tensor)]
