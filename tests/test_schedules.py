"""Schedule generators, the registry, the communication pass, the validator and schedule files."""

from collections import defaultdict

import pytest

from megapipe.errors import ConfigError, ScheduleError
from megapipe.schedules.actions import Action, ActionKind, Schedule, parse_action
from megapipe.schedules.communication import add_communication
from megapipe.schedules.schedule_file import load_schedule, save_schedule
from megapipe.schedules import catalog as schedules
from megapipe.schedules.catalog import build_schedule, register_schedule, schedule_names
from megapipe.schedules.catalog.descriptor import ScheduleDescriptor
from megapipe.schedules.validate import validate_schedule

pytestmark = pytest.mark.unit


def lists_from_text(text):
    return [[parse_action(token) for token in line.split()] for line in text.strip().splitlines()]


def compute_only(name, p, m, v, text):
    return Schedule(name, p, m, v, lists_from_text(text))


def all_configs():
    """(name, p, m, v) for every built-in schedule over p = 1..8 and several m and v."""
    for p in range(1, 9):
        for m in sorted({1, p, p + 1, 2 * p, 3 * p + 2}):
            yield "gpipe", p, m, 1
            if m >= p:
                yield "1f1b", p, m, 1
            if m % p == 0:
                for v in (1, 2, 3, 4):
                    yield "interleaved", p, m, v


# ---------------------------------------------------------------- generators, by hand from the papers

def test_gpipe_runs_all_forwards_then_all_backwards():
    expected = lists_from_text("""
        F0.0 F0.1 F0.2 B0.0 B0.1 B0.2 STEP
        F1.0 F1.1 F1.2 B1.0 B1.1 B1.2 STEP""")
    assert list(build_schedule("gpipe", 2, 3).compute_only().actions) == [tuple(a) for a in expected]


def test_1f1b_warms_up_then_alternates_then_cools_down():
    # rank r: p - r - 1 warm-up forwards (3, 2, 1, 0 for p=4), then F/B pairs, then the remaining B.
    expected = lists_from_text("""
        F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 B0.2 B0.3 B0.4 STEP
        F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 F1.4 B1.2 B1.3 B1.4 STEP
        F2.0 F2.1 B2.0 F2.2 B2.1 F2.3 B2.2 F2.4 B2.3 B2.4 STEP
        F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 F3.4 B3.4 STEP""")
    assert list(build_schedule("1f1b", 4, 5).compute_only().actions) == [tuple(a) for a in expected]


def test_interleaved_follows_megatron_order():
    # p=2, v=2, m=4: rank r warms up with 2(p-r-1) + (v-1)p forwards (4 and 2); forwards go through
    # chunk 0 for a group of p microbatches, then chunk 1; backwards visit the chunks in reverse.
    expected = lists_from_text("""
        F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3 STEP
        F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3 STEP""")
    assert list(build_schedule("interleaved", 2, 4, 2).compute_only().actions) == [tuple(a) for a in expected]


@pytest.mark.parametrize("name, p, m, v", list(all_configs()))
def test_every_builtin_schedule_is_complete_and_valid(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    validate_schedule(schedule)
    assert (schedule.p, schedule.m, schedule.v) == (p, m, v)
    for rank, actions in enumerate(schedule.actions):
        computes = [(a.kind, a.stage, a.microbatch) for a in actions if a.kind.is_compute]
        expected = {(kind, stage, i) for kind in (ActionKind.F, ActionKind.B)
                    for stage in range(rank, p * v, p) for i in range(m)}
        assert sorted(computes) == sorted(expected)
        assert actions[-1] == Action(ActionKind.STEP)
    # every boundary between consecutive stages crosses ranks when p > 1: one message per
    # boundary, microbatch and direction; none when p == 1.
    sends = sum(a.kind.is_send for actions in schedule.actions for a in actions)
    assert sends == (2 * (p * v - 1) * m if p > 1 else 0)


# ---------------------------------------------------------------- communication pass

@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 6, 1), ("interleaved", 2, 4, 3), ("interleaved", 4, 8, 2),
                                           ("gpipe", 3, 5, 1)])
def test_sends_follow_their_compute_and_receives_match_in_order(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    sent, received = defaultdict(list), defaultdict(list)
    for rank, actions in enumerate(schedule.actions):
        for index, a in enumerate(actions):
            if a.kind.is_send:
                producer = actions[index - 1]
                assert producer.kind.value == a.kind.value[-1] and producer.stage == a.stage
                assert producer.microbatch == a.microbatch
                sent[(rank, a.peer)].append((a.kind.value[-1], a.stage, a.microbatch))
            if a.kind.is_recv:
                assert any(later.kind.is_compute and later.stage == a.stage and later.microbatch == a.microbatch
                           and later.kind.value == a.kind.value[-1] for later in actions[index + 1:])
                producing_stage = a.stage - 1 if a.kind is ActionKind.RECV_F else a.stage + 1
                received[(a.peer, rank)].append((a.kind.value[-1], producing_stage, a.microbatch))
    assert sent == received


def test_interleaving_wraps_from_last_rank_to_first():
    schedule = build_schedule("interleaved", 4, 4, 2)
    assert Action(ActionKind.SEND_F, 3, 2, peer=0) in schedule.actions[3]
    assert Action(ActionKind.RECV_F, 4, 2, peer=3) in schedule.actions[0]
    assert Action(ActionKind.SEND_B, 4, 2, peer=3) in schedule.actions[0]
    assert Action(ActionKind.RECV_B, 3, 2, peer=0) in schedule.actions[3]


def test_add_communication_refuses_lists_that_already_have_it():
    with pytest.raises(ScheduleError, match="compute_only"):
        add_communication(build_schedule("1f1b", 2, 2))


# ---------------------------------------------------------------- validator on hand-made broken schedules

def test_backward_before_forward_is_named_and_marked():
    broken = compute_only("broken", 2, 2, 1, """
        F0.0 F0.1 B0.0 B0.1 STEP
        F1.0 B1.1 F1.1 B1.0 STEP""")
    with pytest.raises(ScheduleError) as error:
        validate_schedule(broken)
    lines = str(error.value).splitlines()
    assert lines[0] == "rank 1 runs B1.1 before F1.1; a backward needs its forward first."
    assert lines[1] == "broken (p=2, m=2, v=1)"
    row = lines.index(next(line for line in lines[1:] if line.startswith("rank 1")))
    carets = lines[row + 1]
    assert carets.strip() == "^^^^" and lines[row][carets.index("^"):].startswith("B1.1")


def test_missing_receive_is_reported_at_its_send():
    full = build_schedule("1f1b", 2, 2)
    lists = [list(actions) for actions in full.actions]
    lists[1].remove(Action(ActionKind.RECV_F, 1, 1, peer=0))
    with pytest.raises(ScheduleError, match=r"rank 0's SEND_F0\.1>1 has no matching RECV_F1\.1<0 on rank 1"):
        validate_schedule(Schedule("broken", 2, 2, 1, lists))


def test_deadlock_names_the_first_blocked_action():
    # rank 0 waits in B0.0 for the gradient of B1.0, while rank 1 waits in F1.1 for an activation that
    # rank 0 only produces after B0.0.
    broken = compute_only("broken", 2, 2, 1, """
        F0.0 B0.0 F0.1 B0.1 STEP
        F1.1 F1.0 B1.0 B1.1 STEP""")
    with pytest.raises(ScheduleError) as error:
        validate_schedule(broken)
    lines = str(error.value).splitlines()
    assert lines[0] == ("deadlock under the gloo transport: every unfinished rank is blocked, first rank 0 at B0.0 "
                        "(position 1); the cycle of waits:")
    assert lines[1] == "  rank 0 at B0.0 waits for the gradient sent by B1.0 on rank 1, not yet sent"
    assert lines[2] == "  rank 1 at F1.1 waits for the activation sent by F0.1 on rank 0, not yet sent"
    assert str(error.value).count("^^^^") == 2  # both blocked heads are marked


def test_deadlock_is_also_found_with_sends_and_receives():
    lists = lists_from_text("""
        F0.0 SEND_F0.0>1 RECV_B0.0<1 B0.0 F0.1 SEND_F0.1>1 RECV_B0.1<1 B0.1 STEP
        RECV_F1.0<0 RECV_F1.1<0 F1.1 F1.0 B1.0 SEND_B1.0>0 B1.1 SEND_B1.1>0 STEP""")
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(Schedule("broken", 2, 2, 1, lists))


def test_forward_before_its_input_could_arrive_is_a_deadlock():
    # Interleaved, p=2, v=2: rank 1 runs stage 3 before stage 1, but stage 3's input comes from
    # stage 2 on rank 0, which needs stage 1's output first.
    broken = compute_only("broken", 2, 1, 2, """
        F0.0 F2.0 B2.0 B0.0 STEP
        F3.0 F1.0 B3.0 B1.0 STEP""")
    with pytest.raises(ScheduleError, match=r"first rank 0 at F2\.0 \(position 1\); the cycle of waits:\n"
                                            r"  rank 0 at F2\.0 waits for the activation sent by F1\.0 on rank 1"):
        validate_schedule(broken)


def test_receives_posted_out_of_send_order_are_rejected():
    lists = lists_from_text("""
        F0.0 SEND_F0.0>1 F0.1 SEND_F0.1>1 RECV_B0.0<1 B0.0 RECV_B0.1<1 B0.1 STEP
        RECV_F1.1<0 RECV_F1.0<0 F1.0 F1.1 B1.0 SEND_B1.0>0 B1.1 SEND_B1.1>0 STEP""")
    with pytest.raises(ScheduleError, match="receive number 0 from rank 0 is RECV_F1.1<0, but rank 0's send number "
                                            "0 to it is SEND_F0.0>1"):
        validate_schedule(Schedule("broken", 2, 2, 1, lists))


def test_receive_after_its_consumer_is_rejected():
    lists = lists_from_text("""
        F0.0 SEND_F0.0>1 RECV_B0.0<1 B0.0 STEP
        F1.0 RECV_F1.0<0 B1.0 SEND_B1.0>0 STEP""")
    with pytest.raises(ScheduleError, match=r"runs F1\.0 before posting the RECV_F1\.0<0"):
        validate_schedule(Schedule("broken", 2, 1, 1, lists))


@pytest.mark.parametrize("text, p, m, v, message", [
    ("F0.0 F0.0 B0.0 STEP", 1, 1, 1, "runs F0.0 twice"),
    ("F0.0 B0.0", 1, 1, 1, "rank 0 has no STEP"),
    ("F0.0 STEP", 1, 1, 1, "never runs B0.0"),
    ("F0.0 F0.1 B0.0 STEP B0.1", 1, 2, 1, "STEP after only 1 of its 2 backwards"),
    ("F0.0 B0.0 F1.0 B1.0 STEP\nSTEP", 2, 1, 1, "names stage 1, which lives on rank 1"),
    ("F0.0 B0.0 F2.0 B2.0 STEP", 1, 1, 2, "names stage 2, but the schedule has only 2 stages"),
    ("F0.0 B0.0 F0.3 STEP", 1, 1, 1, "names microbatch 3, but there are only m=1"),
    ("F0.0 SEND_F0.0>0 B0.0 STEP", 1, 1, 1, "is not a valid message"),
    ("F0.0 SEND_F0.0>2 B0.0 STEP\nF1.0 B1.0 STEP\nF2.0 B2.0 STEP", 3, 1, 1, "its peer must be rank 1"),
    ("SEND_F0.0>1 F0.0 B0.0 STEP\nRECV_F1.0<0 F1.0 B1.0 STEP", 2, 1, 1, "before the F0.0 that makes its tensor"),
])
def test_malformed_lists_are_rejected_with_the_reason(text, p, m, v, message):
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(Schedule("broken", p, m, v, lists_from_text(text)))


# ---------------------------------------------------------------- registry and bad sizes

def test_1f1b_with_fewer_microbatches_than_stages_names_the_flags():
    with pytest.raises(ConfigError, match=r"--global-batch-size .* gives m=3 microbatches, fewer than "
                                          r"--pipeline-model-parallel-size 4"):
        build_schedule("1f1b", 4, 3)


def test_interleaved_needs_a_multiple_of_p_microbatches():
    with pytest.raises(ConfigError, match="m=6 to be a multiple of --pipeline-model-parallel-size 4"):
        build_schedule("interleaved", 4, 6, 2)


def test_chunks_need_a_chunked_schedule():
    for name in ("gpipe", "1f1b"):
        with pytest.raises(ConfigError, match=f"gives v=2 model chunks per rank, but --pipeline-schedule {name} "
                                              "has none; use .*interleaved"):
            build_schedule(name, 2, 4, 2)


def test_unknown_schedule_lists_the_known_ones():
    with pytest.raises(ConfigError, match="--pipeline-schedule zigzag is unknown; choose one of 1f1b, dualpipev, "
                                          "gpipe, interleaved"):
        build_schedule("zigzag", 2, 4)


@pytest.mark.parametrize("p, m, v, flag", [(0, 4, 1, "--pipeline-model-parallel-size"), (2, 0, 1, "microbatches"),
                                           (2, 4, 0, "--num-layers-per-virtual-pipeline-stage")])
def test_sizes_below_one_are_rejected(p, m, v, flag):
    with pytest.raises(ConfigError, match=flag):
        build_schedule("interleaved", p, m, v)


def test_a_registered_generator_is_lowered_and_validated(monkeypatch):
    monkeypatch.setattr(schedules, "_REGISTRY", dict(schedules._REGISTRY))  # the test schedules leave with the test

    def backwards_in_reverse(p, m):
        return [[Action(ActionKind.F, r, i) for i in range(m)] + [Action(ActionKind.B, r, i) for i in reversed(range(m))]
                + [Action(ActionKind.STEP)] for r in range(p)]

    def broken(p, m):
        return [[Action(ActionKind.B, r, 0), Action(ActionKind.F, r, 0), Action(ActionKind.STEP)] for r in range(p)]

    register_schedule(ScheduleDescriptor("test-reverse", backwards_in_reverse, "backwards in reverse order"))
    register_schedule(ScheduleDescriptor("test-broken", broken, "a backward before its forward"))
    assert {"test-reverse", "test-broken"} <= set(schedule_names())
    schedule = build_schedule("test-reverse", 3, 4)
    assert schedule.has_communication and schedule.actions[0][-2] == Action(ActionKind.B, 0, 0)
    with pytest.raises(ScheduleError, match="backward needs its forward"):
        build_schedule("test-broken", 2, 1)
    with pytest.raises(ValueError, match="already registered"):
        register_schedule(ScheduleDescriptor("gpipe", backwards_in_reverse, "a second gpipe"))


# ---------------------------------------------------------------- schedule files

@pytest.mark.parametrize("suffix", [".txt", ".csv"])
@pytest.mark.parametrize("name, p, m, v", [("1f1b", 4, 6, 1), ("interleaved", 2, 4, 3), ("gpipe", 1, 3, 1)])
def test_schedule_files_round_trip(tmp_path, suffix, name, p, m, v):
    built = build_schedule(name, p, m, v)
    for written in (built, built.compute_only()):
        path = tmp_path / f"schedule{suffix}"
        save_schedule(written, path)
        assert load_schedule(path, name=name) == built


def test_hand_written_file_loads_like_the_builtin(tmp_path):
    path = tmp_path / "my-1f1b.txt"
    path.write_text("# PipeDream-Flush, p=2, m=3\n\nF0.0 F0.1 B0.0 F0.2 B0.1 B0.2 STEP\n"
                    "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 STEP\n")
    loaded = load_schedule(path)
    assert loaded.name == "my-1f1b"
    assert loaded.actions == build_schedule("1f1b", 2, 3).actions


def test_csv_file_with_step_rows(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("rank,kind,stage,microbatch\n0,F,0,0\n1,F,1,0\n1,B,1,0\n0,B,0,0\n0,STEP,,\n1,STEP,,\n")
    assert load_schedule(path).actions == build_schedule("gpipe", 2, 1).actions


@pytest.mark.parametrize("filename, content, message", [
    ("a.txt", "F0.0 B0.0 STEP\nF1.0 X1.0 STEP\n", r"a.txt line 2: cannot read action 'X1.0'"),
    ("b.txt", "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 STEP\nSTEP\n", "stages 0..2 on 2 ranks"),
    ("c.txt", "# nothing\n", "holds no actions"),
    ("d.csv", "0,F,0,0\n0,B,0,0\n0,STEP,,\n2,STEP,,\n", "no actions for rank 1"),
    ("e.csv", "0,F,zero,0\n", r"e.csv line 1: cannot read '0,F,zero,0'"),
    ("f.csv", "0,FORWARD,0,0\n", r"f.csv line 1: cannot read"),
    ("g.txt", "F0.0 B0.0\n", "rank 0 has no STEP"),
])
def test_bad_schedule_files_are_rejected(tmp_path, filename, content, message):
    path = tmp_path / filename
    path.write_text(content)
    with pytest.raises(ScheduleError, match=message):
        load_schedule(path)


def test_missing_schedule_file():
    with pytest.raises(ScheduleError, match="does not exist"):
        load_schedule("no/such/schedule.txt")
