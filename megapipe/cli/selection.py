"""``--pipeline-schedule auto``: the schedule searched for this run's stage costs.

The costs of each pipeline rank (forward, BI and BW of one microbatch through all its chunks)
come from the flags ``--schedule-forward-time`` / ``--schedule-input-backward-time`` /
``--schedule-weight-backward-time`` (one value for all ranks or one per rank, any unit), or
from a profile written by ``tools/profile_model.py`` (``--schedule-profile``): the layers of each
stage of this run's split (equal layers, or the ``--pipeline-stages`` plan) at its micro-batch
size and tensor-parallel size, with full recomputation's backward when it recomputes. The
profile times the whole backward; BI and BW get half of it each (the split backward defers the
linear layers' weight-gradient products, about half its work), as the planner assumes. With
neither, each stage's costs are its model FLOPs (``flop_costs``): what a user who gives nothing
gets, right wherever a device runs matrix products at one rate. The
search (``schedules/analysis/schedule_search.py``) is deterministic, so every process finds the
same lists without talking to the others.
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction
from typing import Optional

from megapipe.config import Config
from megapipe.errors import ConfigError
from megapipe.layout.stage_plan import equal_split
from megapipe.models.flops import head_forward_flops, layer_forward_flops
from megapipe.schedules.analysis.schedule_search import MEMORY_FLAG, SearchResult, check_memory_limit, search_schedule
from megapipe.schedules.analysis.simulate import CostModel
from megapipe.schedules.catalog import SEARCHED

AUTO = SEARCHED.name


def check_search_flags(config: Config, p: int) -> None:
    """One sentence per mistake, before any process group exists."""
    par, search = config.parallel, config.parallel.schedule_search
    if par.pipeline_schedule != AUTO:
        if search.given():
            raise ConfigError(f"the --schedule-* cost flags and {MEMORY_FLAG} are read only by --pipeline-schedule "
                              f"auto; drop them or use it (this run has --pipeline-schedule {par.pipeline_schedule}).")
        return
    if par.schedule_file is not None:
        raise ConfigError("--schedule-file and --pipeline-schedule auto both choose the schedule; keep one.")
    if search.profile is not None and search.forward_time is not None:
        raise ConfigError("--schedule-profile and --schedule-forward-time both give the stage costs; keep one.")
    for flag, times in (("--schedule-forward-time", search.forward_time),
                        ("--schedule-input-backward-time", search.input_backward_time),
                        ("--schedule-weight-backward-time", search.weight_backward_time)):
        if times is not None and (len(times) not in (1, p) or min(times) <= 0):
            raise ConfigError(f"{flag} {','.join(map(str, times))} must give one positive time for every one of "
                              f"the {p} pipeline ranks, or one for all.")
    if search.latency < 0:
        raise ConfigError(f"--schedule-latency {search.latency} must not be negative.")
    if search.memory_limit is not None:
        check_memory_limit(search.memory_limit)


def check_profile(kind: str, config: Config) -> None:
    """Refuse a missing profile or one of another model before any process group exists; the
    vocabulary is checked later, once the tokenizer has given it."""
    from megapipe.planner.profile import ModelProfile, ModelShape

    path = config.parallel.schedule_search.profile
    profile = ModelProfile.load(path)
    expected = dataclasses.replace(ModelShape.from_config(kind, config.model), vocab_size=profile.shape.vocab_size)
    profile.shape.check_same(expected, f"profile {path}")


def stage_costs(kind: str, config: Config, p: int, v: int) -> CostModel:
    """Per-rank F, BI and BW times of this run, split over its v chunks (module docstring)."""
    search = config.parallel.schedule_search
    if search.profile is None and search.forward_time is None:
        return flop_costs(config, p, v, _exact(search.latency))
    if search.profile is None:
        forward = search.forward_time
        return CostModel.per_rank(p, v, forward, search.input_backward_time or forward,
                                  search.weight_backward_time or forward, latency=_exact(search.latency))
    forward, backward = _profiled_times(kind, config, p, v)
    return CostModel(forward=forward, backward=backward, input_backward=tuple(b / 2 for b in backward),
                     weight_backward=tuple(b / 2 for b in backward), latency=_exact(search.latency))


def flop_costs(config: Config, p: int, v: int, latency: Fraction) -> CostModel:
    """Every stage's F, BI and BW of one microbatch in model GFLOPs (its layers, and the logit layer on the
    last). A layer's weight-gradient products (BW) cost its forward less the attention scores and values,
    which have no weights; BI computes the linears' input gradients (as many) and the attention's backward
    (twice its forward): the forward plus the attention. The logit layer costs its forward in each."""
    model, par = config.model, config.parallel
    tokens = config.training.micro_batch_size * model.seq_length / par.tensor
    attention = 4 * tokens * model.seq_length * model.hidden_size  # scores and values, no weights
    forward, input_backward, weight_backward = [], [], []
    ranges = par.layer_ranges(model.num_layers) if p * v == par.pipeline * par.virtual_pipeline \
        else equal_split(model.num_layers, p * v).layer_ranges  # another v, compared with the run's
    for stage, (first, last) in enumerate(ranges):
        layers = range(first, last)
        flops = sum(layer_forward_flops(tokens, model, layer) for layer in layers)
        head = head_forward_flops(tokens, model.hidden_size, model.padded_vocab_size(par.tensor)) \
            if stage == p * v - 1 else 0.0
        forward.append(_exact((flops + head) / 1e9))
        input_backward.append(_exact((flops + len(layers) * attention + head) / 1e9))
        weight_backward.append(_exact((flops - len(layers) * attention + head) / 1e9))
    return CostModel(forward=tuple(forward), input_backward=tuple(input_backward),
                     weight_backward=tuple(weight_backward),
                     backward=tuple(a + b for a, b in zip(input_backward, weight_backward)), latency=latency)


def searched_schedule(kind: str, config: Config, p: int, m: int, v: int) -> SearchResult:
    search = config.parallel.schedule_search
    limit = Fraction(p) if search.memory_limit is None else _exact(search.memory_limit)
    return _search(p, m, v, stage_costs(kind, config, p, v), limit)


@functools.lru_cache(maxsize=4)  # the configuration check and the trainer ask for the same search
def _search(p: int, m: int, v: int, costs: CostModel, limit: Fraction) -> SearchResult:
    return search_schedule(p, m, costs, limit, v, name=AUTO)


def _profiled_times(kind: str, config: Config, p: int, v: int) -> tuple[tuple[Fraction, ...], tuple[Fraction, ...]]:
    from megapipe.planner.cost_model import profile_layers
    from megapipe.planner.profile import ModelProfile, ModelShape

    model, par = config.model, config.parallel
    profile = ModelProfile.load(par.schedule_search.profile, ModelShape.from_config(kind, model))
    costs = profile.costs(config.training.micro_batch_size / par.tensor)
    backward = costs.recompute_backward if model.recompute_granularity == "full" else costs.backward
    ranges = par.layer_ranges(model.num_layers)
    forward_times, backward_times = [], []
    for stage in range(p * v):
        layers = profile_layers(ranges, stage)
        forward_times.append(_exact(float(costs.forward[layers].sum())))
        backward_times.append(_exact(float(backward[layers].sum())))
    return tuple(forward_times), tuple(backward_times)


def _exact(value: Optional[float]) -> Fraction:
    return Fraction(value).limit_denominator(10 ** 6)
