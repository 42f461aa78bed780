"""The lighthouse's quorum (``replicas/quorum.py``, ``replicas/lighthouse.py``) and the flags of
``--fault-tolerant-replicas`` (``cli/fault_tolerance.py``), in one process.

The rounds are checked on a clock the test moves: against every set of arrivals, silences and sessions of
three replicas, the quorum is exactly the replicas that arrived and are not silent, and it keeps its id
exactly when its members and their sessions stay the same and nobody asked for new groups, while a member
that is alive but has not arrived holds the round (a brute-force enumeration of the rule the module
docstring states).
"""

from __future__ import annotations

import itertools
import json
import threading
import urllib.error
import urllib.request

import pytest

from megapipe.cli.parse import parse_run
from megapipe.errors import ConfigError
from megapipe.replicas.group import LighthouseError, _post
from megapipe.replicas.lighthouse import serve
from megapipe.replicas.quorum import Quorum, Rounds

pytestmark = pytest.mark.unit
HEARTBEAT, JOIN = 5.0, 30.0


def _first_quorum(rounds: Rounds, replicas: int) -> Quorum:
    for replica in range(replicas):
        rounds.arrive(replica, 0, f"s{replica}", 0.0)
    return rounds.decide(0.0)


def test_the_first_round_waits_for_every_replica_of_the_job_up_to_the_join_timeout():
    rounds = Rounds(3, HEARTBEAT, JOIN)
    rounds.arrive(0, 0, "a", 0.0)
    rounds.arrive(2, 0, "c", 1.0)
    assert rounds.decide(1.0) is None and rounds.waiting_for(1.0) == [1]
    for replica in (0, 2):  # waiting, alive: their heartbeats go on
        rounds.heartbeat(replica, JOIN)
    assert rounds.decide(JOIN) is None  # not yet past it
    quorum = rounds.decide(JOIN + 0.1)
    assert quorum.members == (0, 2) and quorum.id == 0


def _check_round(arrived, silent, relaunched, renew) -> None:
    rounds = Rounds(3, HEARTBEAT, JOIN)
    first = _first_quorum(rounds, 3)
    now = 100.0
    for replica in range(3):
        if not silent[replica]:
            rounds.heartbeat(replica, now - 1)
    for replica in range(3):
        if arrived[replica]:
            rounds.arrive(replica, 7, f"s{replica}" + ("-new" if relaunched[replica] else ""), now - 1, renew and
                          replica == 0)
            if silent[replica]:  # it arrived, then went silent: it died while waiting
                rounds.seen[replica] = now - HEARTBEAT - 1
    quorum = rounds.decide(now)
    if any(not arrived[r] and not silent[r] for r in range(3)) or all(silent[r] for r in range(3) if arrived[r]):
        assert quorum is None  # alive and not yet arrived (within the join timeout), or nobody alive arrived
        return
    expected = tuple(r for r in range(3) if arrived[r] and not silent[r])
    assert quorum.members == expected
    unchanged = (expected == first.members and not any(relaunched[r] for r in expected)
                 and not (renew and 0 in expected))
    assert (quorum.id == first.id) == unchanged


def test_the_quorum_is_the_arrived_replicas_not_silent_and_keeps_its_id_only_when_nothing_changed():
    cases = itertools.product(itertools.product([False, True], repeat=3), itertools.product([False, True], repeat=3),
                              itertools.product([False, True], repeat=3), (False, True))
    for case in cases:
        try:
            _check_round(*case)
        except AssertionError as failure:
            raise AssertionError(f"arrived, silent, relaunched, renew = {case}") from failure


def test_a_member_that_heartbeats_but_never_arrives_is_dropped_after_the_join_timeout():
    rounds = Rounds(2, HEARTBEAT, JOIN)
    _first_quorum(rounds, 2)
    rounds.arrive(0, 3, "s0", 50.0)
    for now in range(50, 82, 2):
        rounds.heartbeat(0, float(now))  # waiting for the quorum
        rounds.heartbeat(1, float(now))  # alive, but stuck before its arrival
        if now < 50 + JOIN:
            assert rounds.decide(float(now)) is None
    assert rounds.decide(50.0 + JOIN + 0.5).members == (0,)


def test_a_replica_behind_the_others_receives_the_state_of_the_first_most_advanced():
    quorum = Quorum(4, (0, 1, 2), (12, 3, 12), ("a", "b", "c"))
    assert (quorum.newest, quorum.source, quorum.behind) == (12, 0, (1,))
    assert Quorum.from_json(json.loads(json.dumps(quorum.to_json()))) == quorum


@pytest.fixture(scope="module")
def lighthouse():
    server = serve(2, "127.0.0.1", 0, heartbeat_timeout=HEARTBEAT, join_timeout=JOIN, store_port=0,
                   announce=lambda *args, **kwargs: None)
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_two_replicas_arriving_together_get_one_quorum_and_the_store_port(lighthouse):
    answers = {}

    def arrive(replica):
        answers[replica] = _post(lighthouse, "/quorum", {"replica": replica, "iteration": 0, "session": f"t{replica}",
                                                        "fingerprint": "F"}, 10)

    threads = [threading.Thread(target=arrive, args=(replica,)) for replica in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert answers[0] == answers[1] and answers[0]["quorum"]["members"] == [0, 1] and answers[0]["store_port"] > 0


def test_a_replica_started_with_other_flags_than_the_first_is_refused():
    server = serve(1, "127.0.0.1", 0, store_port=0, announce=lambda *args, **kwargs: None)
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        first = _post(address, "/quorum", {"replica": 0, "iteration": 0, "session": "a", "fingerprint": "F"}, 10)
        assert first["quorum"]["members"] == [0]
        with pytest.raises(LighthouseError, match=r"replica 0 was started with G, but the job's replicas run F; "
                                                  "start every replica with the same flags but --replica-id"):
            _post(address, "/quorum", {"replica": 0, "iteration": 0, "session": "b", "fingerprint": "G"}, 10)
    finally:
        server.shutdown()


@pytest.mark.parametrize("body, sentence", [
    (b"[1]", "not a JSON object"),
    (b'{"iteration": 1, "session": "x"}', "field 'replica' is missing"),
    (b'{"replica": 5, "iteration": 1, "session": "x"}', "replica 5 is not one of this job's 2"),
    (b'{"replica": 0, "iteration": "7", "session": "x"}', "field 'iteration' is missing or not a number"),
    (b'{"replica": true, "iteration": 1, "session": "x"}', "field 'replica' is missing"),
    (b'{"replica": 0, "iteration": 1, "session": "x"}', "field 'fingerprint' is missing or not a string"),
])
def test_the_lighthouse_refuses_a_bad_arrival_with_one_sentence(lighthouse, body, sentence):
    request = urllib.request.Request(f"http://{lighthouse}/quorum", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400 and sentence in json.loads(refused.value.read())["error"]


def test_a_replica_refused_by_the_lighthouse_or_unable_to_reach_it_says_so(lighthouse):
    with pytest.raises(LighthouseError, match="refused replica 9: replica 9 is not one of this job's 2"):
        _post(lighthouse, "/quorum", {"replica": 9, "iteration": 0, "session": "x", "fingerprint": "F"}, 10)

    with pytest.raises(LighthouseError, match=r"did not answer .*start it before the replicas"):
        _post("127.0.0.1:9", "/quorum", {"replica": 0, "iteration": 0, "session": "x"}, 5)


REPLICAS = ["--fault-tolerant-replicas", "2", "--replica-id", "0", "--lighthouse", "10.0.0.1:29600",
            "--micro-batch-size", "2", "--global-batch-size", "8"]


@pytest.mark.parametrize("flags, sentence", [
    (["--replica-id", "1"], "--replica-id and --lighthouse belong to --fault-tolerant-replicas N"),
    (REPLICAS[:2] + REPLICAS[4:], "needs --replica-id K with K from 0 to 1"),
    (REPLICAS[:6] + ["--lighthouse", "10.0.0.1"], "needs --lighthouse HOST:PORT"),
    (REPLICAS + ["--global-batch-size", "6"], "cannot be split over 2 surviving replica(s)"),
    (REPLICAS + ["--pipeline-schedule", "2bw"], "PipeDream and 2BW update without a flush"),
    (REPLICAS + ["--pipeline-schedule", "auto"], "needs a named flush schedule"),
    (REPLICAS + ["--enable-optimizer-post-validation", "--pipeline-model-parallel-size", "2"],
     "cannot run with --enable-optimizer-post-validation"),
    (REPLICAS + ["--replica-timeout-seconds", "0"], "--replica-timeout-seconds 0 must be above 0"),
    (REPLICAS + ["--pipeline-schedule", "zbv", "--global-batch-size", "16", "--micro-batch-size", "4"],
     "2 surviving replica(s) would run 1 microbatch(es) each, which --pipeline-schedule zbv cannot"),
])
def test_fault_tolerant_replica_flags_are_checked_with_one_sentence_each(flags, sentence):
    with pytest.raises(ConfigError) as refused:
        parse_run("gpt", flags, world_size=2)
    assert sentence in str(refused.value) and str(refused.value).count(".") >= 1


def test_replicas_plan_microbatches_for_every_replica_alive():
    assert parse_run("gpt", REPLICAS, world_size=1).microbatches == 2  # 8 / (2 x d=1 x 2 replicas)
