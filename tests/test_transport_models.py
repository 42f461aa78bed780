"""Every registered schedule lowers to lists that finish under both transport models, for every
(p, m, v) its generator accepts among p = 2..8, m in {p, p + 1, 2p - 1, 2p, 4p}, v = 1..3 (the least m
of each V schedule included).

The reference is the transport models themselves (``schedules/transport.py``): a replay under
gloo's rules (each message on its own) and under NCCL's (groups complete as one unit, a rank's
groups in issue order, a compute waits for the whole group holding its receive). Asynchronous
schedules are checked over their unrolled form with a collective between every two calls, which
is what the training loop's agreements are.
"""

import pytest

from megapipe.errors import ConfigError, ScheduleError
from megapipe.schedules.actions import ActionKind, Schedule, parse_action
from megapipe.schedules.communication import add_communication
from megapipe.schedules.replay import replay
from megapipe.schedules.schedule_file import load_training_schedule
from megapipe.schedules.catalog import build_schedule, build_segmented, schedule_names, schedule_descriptor
from megapipe.schedules.segments import segment_cuts
from megapipe.schedules.transport import ALL_TRANSPORTS, Transport, group_ids
from megapipe.schedules.validate import validate_schedule

pytestmark = pytest.mark.unit


def _cases():
    for name in schedule_names():
        for p in range(2, 9):
            for m in sorted({p, p + 1, 2 * p - 1, 2 * p, 4 * p}):
                for v in (1, 2, 3):
                    yield name, p, m, v


def _buildable(name, p, m, v):
    try:
        return build_schedule(name, p, m, v) if not schedule_descriptor(name).asynchronous else \
            build_segmented(name, p, m, v, batches=4)
    except (ConfigError, ScheduleError) as error:
        if "deadlock" in str(error):
            raise
        return None


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_replays_under_both_transports(name):
    checked = 0
    for _, p, m, v in (case for case in _cases() if case[0] == name):
        built = _buildable(name, p, m, v)
        if built is None:
            continue
        schedule = built if isinstance(built, Schedule) else built.schedule
        barriers = None if isinstance(built, Schedule) else [list(s) for s in built.starts]
        for transport in ALL_TRANSPORTS:
            steps = replay(schedule, transport=transport, barriers=barriers)
            assert len(steps) == sum(len(actions) for actions in schedule.actions)
        checked += 1
    assert checked > 0


def _old_lowering_of_interleaved_2bw():
    """2BW, p=2, m=4, v=2 lowered as before transport models existed: receives placed without the
    calls' collectives and with zero-time updates, then moved to the start of their consumer's call."""
    spec = schedule_descriptor("2bw")

    def unrolled(n):
        return Schedule("2bw", 2, 4, 2, spec.generate(p=2, m=4, v=2, batches=n, replicas=None,
                                                         vertical_sync=False), batches=n)

    compute = unrolled(4)
    zero_time_updates = (lambda rank, action: {"F": 1, "B": 2}.get(action.kind.value, 0))
    return compute, add_communication(compute, duration=zero_time_updates), segment_cuts(compute, unrolled(5))


def test_interleaved_2bw_regression_old_placement_deadlocks_under_nccl_only():
    # the case of the issue: rank 0 posts SEND_F0.4>1 with RECV_B2.2<1 in one group, while the
    # receive matching that send waits on rank 1 behind SEND_B3.3>0
    compute, lowered, cuts = _old_lowering_of_interleaved_2bw()
    moved = _confine_to_consumer_call(lowered, cuts)
    replay(moved, transport=Transport.GLOO)  # gloo's independent progress finishes it
    with pytest.raises(ScheduleError, match="deadlock under the nccl transport") as error:
        replay(moved, transport=Transport.NCCL)
    text = str(error.value)
    assert "the cycle of waits:" in text and "^^^^" in text
    assert "rank 0 at B2.2v0" in text and "F0.4" in text
    # the lowering of today gives lists that finish under both, with a collective between calls
    today = build_segmented("2bw", 2, 4, 2, batches=4)
    for transport in ALL_TRANSPORTS:
        replay(today.schedule, transport=transport, barriers=[list(s) for s in today.starts])


def _confine_to_consumer_call(lowered, cuts):
    """The former rule: a receive posted in an earlier call than its consumer moves to the start of
    the consumer's call (kept here only to reproduce its lists)."""
    lists = []
    for rank, actions in enumerate(lowered.actions):
        computes = [a for a in actions if not a.kind.is_communication]
        where = {(a.kind, a.stage, a.microbatch): c for c, a in enumerate(computes)}
        call_of = lambda c: sum(1 for cut in cuts[rank] if cut <= c)  # noqa: E731
        out, moved, compute_index = [], {}, 0
        pending = []
        for action in actions:
            if action.kind.is_recv:
                consumer = where[(_consumer_kind(action), action.stage, action.microbatch)]
                if call_of(consumer) > call_of(compute_index):
                    start = cuts[rank][call_of(consumer) - 1]
                    moved.setdefault(start, []).append(action)
                    continue
                pending.append(action)
                continue
            if not action.kind.is_communication:
                out += moved.pop(compute_index, []) + pending
                pending = []
                compute_index += 1
            out.append(action)
        lists.append(out)
    return lowered.with_actions(lists)


def _consumer_kind(recv):
    return ActionKind.F if recv.kind is ActionKind.RECV_F else ActionKind.B


def test_groups_never_span_calls():
    actions = [parse_action(a) for a in "RECV_F1.0<0 F1.0 SEND_B1.0>0 RECV_F1.1<0 F1.1".split()]
    assert group_ids(actions) == [0, -1, 1, 1, -1]
    assert group_ids(actions, breaks=(3,)) == [0, -1, 1, 2, -1]


def test_nccl_group_deadlock_gloo_finishes():
    # rank 1 posts both activation receives in one group; the second activation is sent by rank 0
    # in a group queued behind rank 0's first group, which also holds the receive of a gradient
    # that rank 1 sends only after its first group completes: a cycle under NCCL, none under gloo.
    lists = [[parse_action(a) for a in line.split()] for line in (
        "F0.0 SEND_F0.0>1 RECV_B0.0<1 F0.1 SEND_F0.1>1 B0.0 RECV_B0.1<1 B0.1 STEP",
        "RECV_F1.0<0 RECV_F1.1<0 F1.0 B1.0 SEND_B1.0>0 F1.1 B1.1 SEND_B1.1>0 STEP")]
    schedule = Schedule("crossed", 2, 2, 1, lists)
    validate_schedule(schedule, transports=[Transport.GLOO])
    with pytest.raises(ScheduleError, match="deadlock under the nccl transport") as error:
        validate_schedule(schedule)
    assert "the cycle of waits:" in str(error.value)


def test_schedule_file_that_deadlocks_under_nccl_is_refused_with_its_grid(tmp_path):
    path = tmp_path / "crossed.txt"
    path.write_text("F0.0 SEND_F0.0>1 RECV_B0.0<1 F0.1 SEND_F0.1>1 B0.0 RECV_B0.1<1 B0.1 STEP\n"
                    "RECV_F1.0<0 RECV_F1.1<0 F1.0 B1.0 SEND_B1.0>0 F1.1 B1.1 SEND_B1.1>0 STEP\n")
    with pytest.raises(ScheduleError, match="deadlock under the nccl transport") as error:
        load_training_schedule(path, p=2, m=2, v=1)
    assert "rank 0  F0.0" in str(error.value) and "^^^^" in str(error.value)


def test_schedule_file_for_other_sizes_names_the_flag(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("F0.0 F0.1 B0.0 B0.1 STEP\nF1.0 B1.0 F1.1 B1.1 STEP\n")
    assert load_training_schedule(path, p=2, m=2, v=1).has_communication
    with pytest.raises(ConfigError, match=r"--schedule-file .* is written for p=2, m=2, v=1, but this run has p=2 "
                                          r"\(--pipeline-model-parallel-size\), m=4"):
        load_training_schedule(path, p=2, m=4, v=1)
