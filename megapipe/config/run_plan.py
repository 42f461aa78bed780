"""A training run resolved once from its flags (``megapipe.cli.resolve``): what the Trainer and the engine
read, so neither derives a fact again, checks a flag again or changes the configuration.

An equal split is one more list of stage layer ranges (``layer_ranges``, one per virtual stage, in stage
order), so the model is built one way whatever the split; the layout (``megapipe.layout.run_layout``) is
an equal split's ``RankLayout`` or a stage plan's ``PlanLayout``, which answer the same queries. The
plan is a value: ``with_vocabulary`` returns another, for the facts only the tokenizer gives.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from megapipe.config.schema import Config
from megapipe.layout.placement import Placement
from megapipe.layout.run_layout import Layout
from megapipe.schedules.actions import Schedule
from megapipe.schedules.analysis.schedule_search import SearchResult
from megapipe.schedules.catalog import schedule_descriptor

if TYPE_CHECKING:
    from megapipe.models.families import Family


@dataclass(frozen=True)
class RunPlan:
    """One run: its model family, layout, stages, schedule, microbatches and collective timeout.

    ``schedule``: a flush schedule's lists, built once (named, read from a file, or what ``--pipeline-schedule
    auto`` found: ``search``), or an asynchronous schedule's name, whose periodic program the engine builds;
    ``auto`` itself only until the vocabulary is known when the search prices a profile
    (``megapipe.cli.resolve.with_vocabulary``). ``device``: where this process computes."""

    kind: str
    family: "Family"
    config: Config
    layout: Layout
    layer_ranges: tuple[tuple[int, int], ...]
    microbatches: int
    schedule: Union[str, Schedule]
    timeout: datetime.timedelta
    device: torch.device
    search: Optional[SearchResult] = None

    @property
    def virtual_pipeline(self) -> int:
        return self.config.parallel.virtual_pipeline

    @property
    def placement(self) -> Placement:
        """Where the schedule puts the virtual stages: its descriptor's, or its lists' (a file, the search)."""
        if isinstance(self.schedule, Schedule):
            return self.schedule.placement
        return schedule_descriptor(self.schedule).placement

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits backwards into BI and BW (the layers must know before they are built)."""
        if isinstance(self.schedule, Schedule):
            return self.schedule.splits_backward
        return schedule_descriptor(self.schedule).split_backward

    def with_vocabulary(self, vocab_size: int) -> "RunPlan":
        """This plan for a tokenizer of ``vocab_size`` tokens: a model configuration of its own, the flags'
        left as they were."""
        model = dataclasses.replace(self.config.model, vocab_size=vocab_size)
        return dataclasses.replace(self, config=dataclasses.replace(self.config, model=model))
