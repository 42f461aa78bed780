"""Every consumer of a schedule's descriptor agrees with it: the built lists (placement, split backward,
alternation), ``build_schedule``'s size checks (the least microbatches are exactly where it starts to
succeed), the simulator (closed forms marked exact), the weight versions the lists hold (the weight
policy's count), the planner (placement, what it plans), the command line (exactly the registered names
and ``auto``) and the table of docs/schedules.md (generated from the registry)."""

import re
import sys
from pathlib import Path

import pytest

from launch_helpers import REPO
from schedule_helpers import assert_closed_forms_match_the_simulator, versions_held
from megapipe.errors import ConfigError
from megapipe.schedules.analysis.simulate import peak_activations
from megapipe.schedules.actions import ActionKind
from megapipe.schedules.catalog import DESCRIPTORS, SEARCHED, accepted_names, build_schedule, schedule_descriptor
from megapipe.schedules.weight_policy import WeightPolicy
from megapipe.planner import schedule_costs

ROOT = Path(REPO)
sys.path.insert(0, str(ROOT / "tools"))
import schedule_table  # noqa: E402

pytestmark = pytest.mark.unit

NAMES = [d.name for d in DESCRIPTORS]
PIPELINES = (1, 2, 3, 4)
CHUNKS = (1, 2, 3)


def microbatches(p):
    return range(1, 2 * p + 3)


def build(name, p, m, v):
    """The built schedule, or None where its generator or the registry refuses the sizes."""
    try:
        return build_schedule(name, p, m, v)
    except ConfigError:
        return None


def test_the_registry_lists_each_schedule_once():
    assert len(set(NAMES)) == len(NAMES) and SEARCHED.name not in NAMES
    assert all(schedule_descriptor(name) is descriptor for name, descriptor in zip(NAMES, DESCRIPTORS))
    assert all(d.generate is not None for d in DESCRIPTORS) and SEARCHED.generate is None


@pytest.mark.parametrize("name", NAMES)
def test_sizes_placement_and_passes_agree_with_the_built_lists(name):
    descriptor = schedule_descriptor(name)
    built, alternates = 0, False
    for p in PIPELINES:
        for v in CHUNKS:
            for m in microbatches(p):
                schedule = build(name, p, m, v)
                accepted = descriptor.sizes.problem(name, p, m, v) is None
                assert (schedule is not None) == accepted, (name, p, m, v, descriptor.sizes.problem(name, p, m, v))
                if schedule is None:
                    continue
                built += 1
                assert schedule.placement is descriptor.placement is schedule_costs.placement_of(name), (p, m, v)
                kinds = [{a.kind for a in actions} for actions in schedule.compute_only().actions]
                assert descriptor.split_backward == any(ActionKind.BI in k for k in kinds), (p, m, v)
                alternates |= any(_forward_after_backward(actions) for actions in schedule.compute_only().actions)
    assert built > 0
    assert descriptor.alternates == alternates  # at some sizes (interleaved at m = p runs every forward first)


def _forward_after_backward(actions) -> bool:
    seen_backward = False
    for action in actions:
        if action.kind.is_backward:
            seen_backward = True
        elif action.kind is ActionKind.F and seen_backward:
            return True
    return False


@pytest.mark.parametrize("name", NAMES)
def test_least_microbatches_is_where_build_schedule_starts_to_succeed(name):
    sizes = schedule_descriptor(name).sizes
    checked = 0
    for p in PIPELINES:
        for v in CHUNKS:
            if not sizes.takes_chunks(v) or p < sizes.least_pipeline:
                assert all(build(name, p, m, v) is None for m in microbatches(p)), (p, v)
                continue
            least = sizes.least_microbatches(p, v)
            assert build(name, p, least, v) is not None, (p, v, least)
            assert least == 1 or build(name, p, least - 1, v) is None, (p, v, least)
            checked += 1
    assert checked > 0


def _planned(descriptor):
    """The (p, m, v) of the grid where the descriptor's closed forms hold."""
    sizes = descriptor.planned_sizes
    return [(p, m, v) for p in PIPELINES for v in CHUNKS for m in microbatches(p)
            if sizes.problem(descriptor.name, p, m, v) is None]


@pytest.mark.parametrize("name", [d.name for d in DESCRIPTORS if d.closed_forms is not None and d.closed_forms.exact])
def test_exact_closed_forms_agree_with_the_simulator(name):
    cases = _planned(schedule_descriptor(name))
    assert cases
    for p, m, v in cases:
        assert_closed_forms_match_the_simulator(name, p, m, v)


@pytest.mark.parametrize("name", [d.name for d in DESCRIPTORS if d.closed_forms is not None
                                  and not d.closed_forms.exact])
def test_steady_state_closed_forms_hold_the_simulated_activations(name):
    cases = _planned(schedule_descriptor(name))
    assert cases
    for p, m, v in cases:
        assert tuple(peak_activations(build_schedule(name, p, m, v))) == \
            tuple(schedule_costs.in_flight(name, p, m, v, r) for r in range(p)), (p, m, v)


@pytest.mark.parametrize("name", NAMES)
def test_weight_versions_follow_the_policy_and_the_lists(name):
    descriptor = schedule_descriptor(name)
    for p in PIPELINES:
        for rank in range(p):
            versions = schedule_costs.weight_versions(name, p, rank)
            assert versions == descriptor.weight_versions(p, rank)
            if descriptor.weight_policy is WeightPolicy.STASH:  # one version per in-flight input
                assert versions == schedule_costs.in_flight(name, p, 1, 1, rank)
            else:
                assert versions == descriptor.weight_policy.most_versions
        for m in (p, 2 * p):
            schedule = build(name, p, m, descriptor.sizes.least_chunks)
            if schedule is None:
                continue
            for rank, actions in enumerate(schedule.actions):
                if descriptor.flushes:  # no pass names a version: every one runs on the live weights
                    assert all(a.version is None for a in actions) and descriptor.weight_versions(p, rank) == 1
                else:
                    assert max(versions_held(actions).values()) == descriptor.weight_versions(p, rank), (p, m, rank)


@pytest.mark.parametrize("name", NAMES + [SEARCHED.name])
def test_the_planner_plans_where_the_descriptor_has_closed_forms(name):
    descriptor = schedule_descriptor(name)
    assert schedule_costs.placement_of(name) is descriptor.placement
    assert (name in schedule_costs.SCHEDULES) == (descriptor.closed_forms is not None or descriptor is SEARCHED)
    assert (name in schedule_costs.FLUSHING) == (name in schedule_costs.SCHEDULES and descriptor.flushes)
    assert schedule_costs.unties_embeddings(name, 2) == (not descriptor.flushes)
    if descriptor is SEARCHED:
        return
    for p in PIPELINES:
        for v in CHUNKS:
            for m in microbatches(p):
                planned = schedule_costs.microbatch_problem(name, p, m, v) is None
                assert planned == (descriptor.closed_forms is not None
                                   and descriptor.planned_sizes.problem(name, p, m, v) is None), (p, m, v)
                if planned:  # the planner plans only what the generator runs
                    assert descriptor.sizes.problem(name, p, m, v) is None, (p, m, v)


def _parse(name):
    from megapipe.cli.parse import parse_config

    descriptor = schedule_descriptor(name)
    p = 2
    argv = ["--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--pipeline-model-parallel-size", str(p), "--pipeline-schedule", name]
    if descriptor.sizes.least_chunks > 1:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(4 // (p * descriptor.sizes.least_chunks))]
    if descriptor.asynchronous:
        argv += ["--untie-embeddings-and-output-weights"]
    if descriptor is SEARCHED:
        argv += ["--schedule-forward-time", "1"]
    return parse_config("gpt", argv, world_size=p)


def test_the_command_line_takes_exactly_the_registered_names_and_auto():
    from megapipe.cli.parse import build_parser

    assert set(accepted_names()) == set(NAMES) | {SEARCHED.name}
    for name in accepted_names():
        assert _parse(name).parallel.pipeline_schedule == name
    with pytest.raises(ConfigError, match=r"--pipeline-schedule 1F1B is unknown \(did you mean 1f1b\? the names are "
                                          r"lower case\); choose one of (.*)\.") as error:
        _parse_unknown("1F1B")
    listed = re.search(r"choose one of (.*)\.$", str(error.value)).group(1).split(", ")
    assert sorted(listed) == sorted(accepted_names()) and SEARCHED.name in listed
    with pytest.raises(ConfigError, match=r"--pipeline-schedule zbh3 is unknown \(did you mean zb-h\d\?\); choose"):
        _parse_unknown("zbh3")
    with pytest.raises(ConfigError, match=r"--pipeline-schedule gantt is unknown; choose one of"):
        _parse_unknown("gantt")
    help_text = next(a.help for a in build_parser("gpt")._actions if "--pipeline-schedule" in a.option_strings)
    assert set(re.findall(r"[a-z0-9-]+", help_text)) >= set(accepted_names())


def _parse_unknown(name):
    from megapipe.cli.parse import parse_config

    return parse_config("gpt", ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                                "--pipeline-schedule", name], world_size=2)


def test_the_docs_table_and_flag_list_are_the_registry_s():
    schedules_page = (ROOT / "docs" / "schedules.md").read_text()
    assert schedule_table.page_table(schedules_page) == schedule_table.schedule_table(), \
        "the schedule table of docs/schedules.md is stale: run python tools/schedule_table.py --write"
    flags_page = (ROOT / "docs" / "training.md").read_text()
    flag_list = re.search(r"`--pipeline-schedule \{([^}]*)\}`", flags_page).group(1).split(",")
    assert sorted(flag_list) == sorted(accepted_names())
