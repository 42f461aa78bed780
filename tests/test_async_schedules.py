"""PipeDream and 2BW schedules as values: versions by the papers' formulas, zero bubble in steady
state, a periodic program equal to the validated unrolled form, and one-sentence errors."""

from fractions import Fraction

import pytest

from megapipe.cli.parse import parse_run
from megapipe.config import ParallelConfig
from megapipe.errors import ConfigError
from megapipe.schedules.actions import ActionKind
from megapipe.schedules.program import PeriodicProgram
from megapipe.schedules.catalog import build_schedule
from megapipe.schedules.catalog.round_robin import noam
from megapipe.schedules.analysis.simulate import CostModel, simulate

pytestmark = pytest.mark.unit

# F = 1, B = 2 per stage (as in the papers' figures); "2-1" of Fig 2.7: the replicated stage takes twice as long.
FIG_2_7 = CostModel(forward=[2, 1], backward=[4, 2])


def busy_in(result, rank, start, end):
    return sum(max(0, min(e.end, end) - max(e.start, start))
               for e in result.timeline.events if e.rank == rank and e.is_compute)


def steady_window(result):
    """From rank 0's first backward (the pipeline is full) to its last forward (the drain begins)."""
    mine = [e for e in result.timeline.events if e.rank == 0 and e.action.kind.is_compute]
    return (min(e.start for e in mine if e.action.kind is ActionKind.B),
            max(e.end for e in mine if e.action.kind is ActionKind.F))


@pytest.mark.parametrize("p", range(1, 7))
def test_straight_pipelines_have_no_bubble_in_steady_state(p):
    for m in sorted({1, p, 2 * p}):
        batches = max(5, -(-3 * p // m))  # at least 3p microbatches, so that a steady state exists
        names = ["pipedream", "2bw"] if m >= p else ["pipedream"]
        for name, vertical_sync in [(n, False) for n in names] + [("pipedream", True)]:
            schedule = build_schedule(name, p, m, batches=batches, vertical_sync=vertical_sync)
            result = simulate(schedule)
            start, end = steady_window(result)
            assert end > start and all(busy_in(result, rank, start, end) == end - start for rank in range(p))
            # the only idle time is filling and draining the pipeline once: 3 (N + p - 1) for N microbatches
            assert result.makespan == 3 * (batches * m + p - 1)


@pytest.mark.parametrize("p, v", [(2, 2), (3, 2), (4, 2), (4, 3)])
def test_interleaved_2bw_has_no_bubble_in_steady_state(p, v):
    # Per-chunk costs F = 1/v, B = 2/v. The warm-up of interleaving ends at different times on each
    # rank, so take the middle third of the run as the steady state.
    result = simulate(build_schedule("2bw", p, 2 * p, v, batches=6), CostModel.per_chunk(v))
    start, end = result.makespan / 3, 2 * result.makespan / 3
    assert all(busy_in(result, rank, start, end) == end - start for rank in range(p))
    assert result.makespan == Fraction(3 * (v * 6 * 2 * p + p - 1), v)  # filled and drained once


def test_two_one_configuration_of_figure_2_7_has_no_bubble_in_steady_state():
    # Worker 1 runs the even microbatches of stage 1, worker 2 the odd ones, worker 3 all of stage 2; the
    # replicas' updates are collectives. After the start-up the three workers never idle.
    schedule = build_schedule("pipedream", 3, 2, batches=10, replicas=(2, 1))
    result = simulate(schedule, FIG_2_7)
    assert [a.microbatch for a in schedule.actions[0] if a.kind is ActionKind.F] == list(range(0, 20, 2))
    assert [a.microbatch for a in schedule.actions[1] if a.kind is ActionKind.F] == list(range(1, 20, 2))
    start, end = 12, result.makespan - 12
    assert [busy_in(result, rank, start, end) for rank in range(3)] == [end - start] * 3


def test_noam_and_in_flight_microbatches():
    assert noam((1, 1, 1, 1)) == 4 and noam((2, 1)) == 2 and noam((15, 1)) == 2  # seed 002 L1317-1336
    straight = simulate(build_schedule("pipedream", 4, 4))
    assert straight.peak_activations == (4, 3, 2, 1)  # stage s holds p - s in flight
    replicated = simulate(build_schedule("pipedream", 3, 2, replicas=(2, 1)), FIG_2_7)
    assert replicated.peak_activations == (2, 2, 1)  # NOAM per input-stage replica


def versions(schedule, kind=ActionKind.F):
    return {(a.stage, a.microbatch): a.version for actions in schedule.actions for a in actions if a.kind is kind}


@pytest.mark.parametrize("p", [1, 2, 4, 5])
def test_version_tags_follow_the_update_rules(p):
    m, batches = p + 1, 4
    total = m * batches
    stash = build_schedule("pipedream", p, m, batches=batches)
    sync = build_schedule("pipedream", p, m, batches=batches, vertical_sync=True)
    double = build_schedule("2bw", p, m, batches=batches)
    for kind in (ActionKind.F, ActionKind.B):
        # Table 7.1: stage s (0-indexed) computes microbatch t's gradient on W_s(t - p + 1 + s) ...
        assert versions(stash, kind) == {(s, k): max(k - (p - 1 - s), 0) for s in range(p) for k in range(total)}
        # ... with vertical sync on W_s(t - p + 1) everywhere; 2BW: max(floor((k-1)/m) - 1, 0), k 1-indexed.
        assert versions(sync, kind) == {(s, k): max(k - (p - 1), 0) for s in range(p) for k in range(total)}
        assert versions(double, kind) == {(s, k): max(k // m - 1, 0) for s in range(p) for k in range(total)}
    updates = [a for a in double.actions[0] if a.kind is ActionKind.UPDATE]
    assert [a.microbatch for a in updates] == [(j + 1) * m - 1 for j in range(batches)]  # one per batch


@pytest.mark.parametrize("name, p, m, v, replicas, vertical_sync", [
    ("pipedream", 1, 1, 1, None, False), ("pipedream", 3, 1, 1, None, False), ("pipedream", 4, 4, 1, None, True),
    ("pipedream", 3, 2, 1, (2, 1), False), ("pipedream", 4, 2, 1, (1, 2, 1), False),
    ("2bw", 2, 3, 1, None, False), ("2bw", 4, 4, 1, None, False), ("2bw", 3, 6, 2, None, False),
    ("2bw", 4, 4, 1, (2, 2), False),
])
def test_calls_and_drain_are_the_validated_unrolled_form(name, p, m, v, replicas, vertical_sync):
    # One call per batch, then a drain: for any number n of batches, what the executor runs on every
    # rank is exactly the unrolled form over n batches that the validator accepted.
    program = PeriodicProgram(name, p, m, v, replicas, vertical_sync)
    for n in range(1, program.horizon + 3):
        unrolled = build_schedule(name, p, m, v, batches=n, replicas=replicas, vertical_sync=vertical_sync)
        for rank in range(p):
            run = sum((program.segment(rank, call) for call in range(n)), ()) + program.drain(rank, n)
            assert run == unrolled.actions[rank], (n, rank)
            for call in range(n):  # call w runs exactly the forwards of batch w that the rank holds
                forwards = {(a.stage, a.microbatch) for a in program.segment(rank, call) if a.kind is ActionKind.F}
                assert forwards == {(s, k) for s in unrolled.stages_on_rank(rank)
                                    for k in unrolled.microbatches_on(rank, s) if call * m <= k < (call + 1) * m}
    assert program.loss_divisor == (1 if name == "pipedream" else m // (replicas or (1,))[0])


@pytest.mark.parametrize("build, message", [
    (lambda: build_schedule("2bw", 4, 3), "m=3 gives fewer than 4"),
    (lambda: build_schedule("2bw", 4, 4, 2), "not well defined for p=4, v=2, m=4.*use m >= 8"),
    (lambda: build_schedule("2bw", 4, 6, 2), "needs m=6 to be a multiple of --pipeline-model-parallel-size 4"),
    (lambda: build_schedule("2bw", 3, 3, replicas=(2, 1)), "needs equally replicated stages"),
    (lambda: build_schedule("pipedream", 4, 4, 2), "pipedream has none; use one of .*interleaved, .*2bw or drop the flag"),
    (lambda: build_schedule("pipedream", 3, 3, replicas=(2, 1)), "m=3 to be a multiple of 2"),
    (lambda: build_schedule("pipedream", 3, 2, replicas=(2, 2)), "add up to 4 workers, not the 3"),
    (lambda: build_schedule("1f1b", 2, 2, vertical_sync=True), "no meaning with --pipeline-schedule 1f1b"),
    (lambda: build_schedule("2bw", 2, 2, vertical_sync=True), "no meaning with --pipeline-schedule 2bw"),
    (lambda: build_schedule("pipedream", 3, 2, replicas=(2, 1), vertical_sync=True), "replicas \\[2, 1\\] differ"),
    (lambda: build_schedule("gpipe", 3, 2, replicas=(2, 1)), "gpipe does not replicate single stages"),
    (lambda: ParallelConfig(pipeline_schedule="2bw", pipedream_vertical_sync=True).validate(),
     "--pipedream-vertical-sync has no meaning with --pipeline-schedule 2bw"),
    (lambda: ParallelConfig(pipeline_schedule="1f1b", pipeline_stages="0:2x2,2:4x1").validate(),
     "replicates its stages unequally .* only --pipeline-schedule pipedream"),
    (lambda: ParallelConfig(pipeline=3, pipeline_schedule="pipedream", pipeline_stages="0:2,2:4").validate(),
     "names 2 stages but --pipeline-model-parallel-size is 3"),
    (lambda: ParallelConfig(pipeline_schedule="pipedream", pipeline_stages="0:2x2,2:4x1").validate(4, 4),
     "replicas add up to 3 workers .* but the world has 4"),
    (lambda: ParallelConfig(pipeline_schedule="pipedream", pipeline_stages="0:2x2,3:4").validate(4, 4),
     "leaves layers 2..2 unassigned"),
])
def test_bad_input_is_one_sentence_naming_the_fix(build, message):
    with pytest.raises(ConfigError, match=message) as error:
        build()
    assert str(error.value).count(". ") == 0 and str(error.value).endswith(".")


def test_updates_per_batch_and_throughput_against_flush():
    # Unit costs: a flush schedule spends 3 (m + p - 1) per batch of m; PipeDream and 2BW 3m in steady state.
    p, m = 4, 4
    flush = simulate(build_schedule("1f1b", p, m)).makespan
    assert Fraction(flush, m) == Fraction(3 * (m + p - 1), m)
    for name in ("pipedream", "2bw"):
        long, short = (simulate(build_schedule(name, p, m, batches=b)).makespan for b in (6, 5))
        assert long - short == 3 * m


TWO_STAGES = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "4",
              "--micro-batch-size", "1", "--global-batch-size", "2", "--pipeline-model-parallel-size", "2",
              "--mock-data", "--vocab-size", "16", "--optimizer", "sgd", "--lr", "0.1"]


@pytest.mark.parametrize("flags, message", [
    ([], "needs --untie-embeddings-and-output-weights"),
    (["--untie-embeddings-and-output-weights", "--recompute-granularity", "full", "--recompute-method", "uniform"],
     "cannot use --recompute-granularity full"),
    (["--untie-embeddings-and-output-weights", "--fp16"], "with --fp16 needs a constant --loss-scale"),
])
def test_what_asynchronous_training_refuses(flags, message):
    """Refused once, when the run is resolved from its flags, before any process group or model exists."""
    for schedule in ("pipedream", "2bw"):
        with pytest.raises(ConfigError, match=message):
            parse_run("gpt", TWO_STAGES + flags + ["--pipeline-schedule", schedule], world_size=2)
    parse_run("gpt", TWO_STAGES + flags + ["--pipeline-schedule", "1f1b"], world_size=2)  # flushes keep one copy
