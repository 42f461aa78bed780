"""The schedule IR: text form round trip and rejection of malformed actions."""

import pytest

from megapipe.errors import ScheduleError
from megapipe.schedules.actions import Action, ActionKind, Schedule, parse_action

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("action", [
    Action(ActionKind.F, 3, 1),
    Action(ActionKind.B, 0, 7, version=2),
    Action(ActionKind.BI, 2, 3),
    Action(ActionKind.BW, 2, 3),
    Action(ActionKind.SEND_F, 3, 1, peer=0),
    Action(ActionKind.RECV_F, 4, 1, peer=3),
    Action(ActionKind.SEND_B, 1, 12, peer=0),
    Action(ActionKind.RECV_B, 2, 5, peer=3),
    Action(ActionKind.STEP),
])
def test_text_form_round_trips(action):
    assert parse_action(str(action)) == action


def test_text_form_is_compact():
    assert str(Action(ActionKind.F, 3, 1)) == "F3.1"
    assert str(Action(ActionKind.SEND_B, 2, 5, peer=1)) == "SEND_B2.5>1"
    assert str(Action(ActionKind.RECV_F, 2, 5, peer=1)) == "RECV_F2.5<1"


@pytest.mark.parametrize("text", ["X1.2", "F1", "F-1.2", "SEND_F1.2", "SEND_F1.2<0", "RECV_B1.2>0", "F1.2>3", "STEP1"])
def test_malformed_text_is_rejected(text):
    with pytest.raises(ScheduleError):
        parse_action(text)


def test_action_fields_are_checked():
    with pytest.raises(ScheduleError, match="peer"):
        Action(ActionKind.SEND_F, 0, 0)
    with pytest.raises(ScheduleError, match="peer"):
        Action(ActionKind.F, 0, 0, peer=1)
    with pytest.raises(ScheduleError, match="STEP"):
        Action(ActionKind.STEP, 0, 0)


def test_interleaved_stage_placement_follows_megatron():
    # 16 layers, p=4, v=2: 2 layers per virtual stage; rank 0 holds stages 0 and 4 = layers 1,2 and 9,10.
    schedule = Schedule("x", p=4, m=4, v=2, actions=[[] for _ in range(4)])
    layers_per_stage = 16 // schedule.num_stages
    layers = [layer + 1 for s in schedule.stages_on_rank(0)
              for layer in range(s * layers_per_stage, (s + 1) * layers_per_stage)]
    assert layers == [1, 2, 9, 10]
    assert [schedule.rank_of_stage(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [schedule.chunk_of_stage(s) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_schedule_needs_one_list_per_rank():
    with pytest.raises(ScheduleError, match="one list per rank"):
        Schedule("x", p=2, m=1, v=1, actions=[[]])
