"""The overlapped pair's plan (``schedules/overlap.py``): which all-to-all runs beside which compute, which
backwards become overlapped, what the simulator charges, how the gate interleaves two threads, and the
flag's refusals."""

import operator
import threading

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megapipe.cli.parse import parse_config
from megapipe.errors import ConfigError
from megapipe.parallel.comm_overlap import PairGate, communicating
from megapipe.schedules.analysis.simulate import CostModel, exposed_expert_comm, overlapped_pair_time, simulate
from megapipe.schedules.overlap import PAIR, Segment, overlapped_pairs
from megapipe.schedules.catalog import build_schedule, overlapped_schedule

pytestmark = pytest.mark.unit

A, D, X, C = Segment.ATTENTION, Segment.DISPATCH, Segment.EXPERTS, Segment.COMBINE


def test_every_slot_puts_one_pass_all_to_all_beside_the_other_pass_compute():
    # DualPipe's order: F attention | B combine, F dispatch | B experts, F experts | B dispatch, F combine | B attention
    assert PAIR.slots(1, 1) == [(None, A), (A, C), (D, X), (X, D), (C, A), (A, None)]
    for forward, backward in PAIR.slots(3, 2):
        if forward is not None and backward is not None:
            assert forward.communicates != backward.communicates


def test_1f1b_steady_state_becomes_overlapped_pairs_and_dualpipev_keeps_its_own():
    one_f_one_b = overlapped_schedule(build_schedule("1f1b", 1, 4))  # Megatron's combined 1F1B
    assert [str(a) for a in one_f_one_b.actions[0]] == ["F0.0", "F0.1", "&B0.0", "F0.2", "&B0.1", "F0.3", "&B0.2",
                                                        "B0.3", "STEP"]
    dualpipev = build_schedule("dualpipev", 2, 4, 2)
    assert overlapped_schedule(dualpipev).actions == dualpipev.actions
    assert overlapped_pairs(overlapped_schedule(build_schedule("interleaved", 2, 8, 2))) == 24


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([("1f1b", 1), ("interleaved", 2), ("dualpipev", 2)]), st.integers(1, 4), st.integers(1, 12))
def test_overlapped_lists_run_the_same_passes_and_pair_only_other_microbatches(named, p, m):
    name, v = named
    try:
        schedule = build_schedule(name, p, m, v)
        overlapped = overlapped_schedule(schedule)
    except ConfigError:
        assume(False)
    for plain, marked in zip(schedule.compute_only().actions, overlapped.compute_only().actions):
        assert sorted(str(a).lstrip("&") for a in plain) == sorted(str(a).lstrip("&") for a in marked)
        for index, action in enumerate(marked):
            if action.overlapped:
                forward = marked[index - 1]
                assert forward.kind.value == "F" and forward.microbatch != action.microbatch


@pytest.mark.parametrize("name, p", [("gpipe", 1), ("1f1b", 2), ("zb-h1", 2)])
def test_a_schedule_without_pairs_that_need_not_wait_is_refused(name, p):
    # GPipe has no forward after a backward; 1F1B's and ZB-H1's pairs beyond one rank wait for each other
    with pytest.raises(ConfigError, match=rf"^--overlap-moe-expert-parallel-comm needs forward/backward pairs that "
                                          rf"need not wait for each other, and --pipeline-schedule {name} has none"):
        overlapped_schedule(build_schedule(name, p, 8))


def test_a_pair_hides_each_all_to_all_up_to_the_other_pass_compute():
    # one MoE layer: F computes 3 (1 per compute segment) and exchanges 2; B computes 6 and exchanges 2
    assert overlapped_pair_time(PAIR, (3, 2), (6, 2), 1) == 1 + max(1, 2) + max(1, 1) + max(1, 2) + max(1, 1) + 2
    assert overlapped_pair_time(PAIR, (3, 0), (6, 0), 1) == 9  # nothing to hide: the computes one after the other
    assert overlapped_pair_time(PAIR, (3, 60), (6, 60), 1) == 1 + 30 + 30 + 30 + 30 + 2  # all-to-alls longer than compute


def test_the_simulator_charges_the_hidden_all_to_all_to_overlapped_pairs_only():
    schedule = overlapped_schedule(build_schedule("1f1b", 1, 8))
    costs = dict(forward=3, backward=6, expert_comm=2, moe_layers=1)  # a pass computes 3 or 6, exchanges 2
    apart = simulate(schedule, CostModel(**costs, overlap=operator.add))
    hidden = simulate(schedule, CostModel(**costs, hide_expert_comm=True))
    plain = simulate(build_schedule("1f1b", 1, 8), CostModel(**costs))
    assert apart.makespan == plain.makespan  # without the overlap a pair is its passes one after the other
    saved = (3 + 2 + 6 + 2) - overlapped_pair_time(PAIR, (3, 2), (6, 2), 1)
    assert 0 < plain.makespan - hidden.makespan <= overlapped_pairs(schedule) * saved


def test_the_exposed_all_to_all_time_is_what_no_pair_hides():
    # F0 F1 &B0 ... F7 &B6 B7: 8 forwards and 8 backwards exchange 2 each, 7 pairs hide 1 + 1 + 1 + 1 each
    schedule = overlapped_schedule(build_schedule("1f1b", 1, 8))
    costs = dict(forward=3, backward=6, expert_comm=2, moe_layers=1)
    assert exposed_expert_comm(schedule, CostModel(**costs, hide_expert_comm=True)) == (16 * 2 - 7 * 4,)
    assert exposed_expert_comm(schedule, CostModel(**costs)) == (16 * 2,)  # passes overlapped whole: none hidden
    slow = CostModel(**dict(costs, expert_comm=60), hide_expert_comm=True)  # each slot hides its compute's length
    assert exposed_expert_comm(schedule, slow) == (16 * 60 - 7 * (1 + 1 + 2 + 2),)


def test_the_gate_runs_one_pass_all_to_all_while_the_other_computes():
    order, lock = [], threading.Lock()

    def log(entry):
        with lock:
            order.append(entry)

    def forward():
        log(("F", A))
        with communicating(D, backward=False):
            log(("F", D))
        log(("F", X))
        with communicating(C, backward=False):
            log(("F", C))
        log(("F", A))

    def backward():
        log(("B", A))
        with communicating(C, backward=True):
            log(("B", C))
        log(("B", X))
        with communicating(D, backward=True):
            log(("B", D))
        log(("B", A))

    gate = PairGate(PAIR)
    thread = threading.Thread(target=gate.run, args=(True, backward))
    thread.start()
    gate.run(False, forward)
    thread.join()
    slots = [order[0:1], order[1:3], order[3:5], order[5:7], order[7:9], order[9:10]]
    for slot, (f, b) in zip(slots, PAIR.slots(1, 1)):
        assert sorted(slot) == sorted(e for e in (("F", f), ("B", b)) if e[1] is not None)


def _parsed(*flags, world=2):
    return parse_config("gpt", ["--model-preset", "mixtral-tiny", "--overlap-moe-expert-parallel-comm", *flags],
                        world_size=world)


@pytest.mark.parametrize("flags, world, message", [
    ((), 2, r"^--overlap-moe-expert-parallel-comm hides the experts' all-to-all, which needs "
            r"--expert-model-parallel-size of at least 2 \(got 1\)"),
    (("--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"), 2,
     r"^--overlap-moe-expert-parallel-comm overlaps the all-to-all dispatcher's exchanges, not "
     r"--moe-token-dispatcher-type allgather's"),
    (("--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
      "--global-batch-size", "8"), 4, r"^--overlap-moe-expert-parallel-comm needs forward/backward pairs that need "
                                      r"not wait for each other, and --pipeline-schedule 1f1b has none at p=2, m=4"),
    (("--expert-model-parallel-size", "2", "--pipeline-schedule", "gpipe"), 2,
     r"^--overlap-moe-expert-parallel-comm needs forward/backward pairs that need not wait for each other, and "
     r"--pipeline-schedule gpipe has none"),
    (("--expert-model-parallel-size", "2", "--recompute-granularity", "selective"), 2,
     r"^--overlap-moe-expert-parallel-comm cannot be combined with --recompute-granularity selective yet"),
])
def test_bad_overlap_flags_are_one_sentence(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        _parsed(*flags, world=world)


def test_overlap_parses_with_expert_parallelism_and_1f1b():
    config = _parsed("--expert-model-parallel-size", "2", world=2)
    assert config.parallel.overlap_moe_expert_parallel_comm
