"""Generation's and scoring's pipeline messages (``PeerMessages``) on two real gloo ranks: tensors
arrive intact in the order sent, and the strict transport holds gloo to NCCL's order on a pair of
ranks. When both ranks send before receiving what the other sent, gloo finishes (each message
progresses on its own) but NCCL, which runs a pair's messages in issue order, would hang: under the
strict transport both ranks fail with the timeout's sentence instead."""

import datetime

import pytest
import torch

from megapipe.errors import PipelineTimeout
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.peer_messages import PeerMessages
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

TIMEOUT = datetime.timedelta(seconds=2)


def _exchange(link: PeerMessages, rank: int, send_first: bool) -> list:
    """Rank 0 sends [0, 1, 2] and rank 1 sends [10, 11, 12]; each receives the other's. Rank 0 always
    sends first; rank 1 receives first unless ``send_first``."""
    mine, peer = torch.arange(3) + 10 * rank, 1 - rank
    if rank == 0 or send_first:
        link.send(mine, peer, "test tensor")
        got = link.recv((3,), torch.long, peer, "test tensor")
    else:
        got = link.recv((3,), torch.long, peer, "test tensor")
        link.send(mine, peer, "test tensor")
    link.finish()
    return got.tolist()


def _checks(rank, world_size):
    ps = ParallelState.initialize(1, 2)
    out = {}
    strict = PeerMessages(ps, torch.device("cpu"), TIMEOUT)
    out["strict"] = strict.strict
    out["matched"] = _exchange(strict, rank, send_first=False)
    relaxed = PeerMessages(ps, torch.device("cpu"), TIMEOUT)
    relaxed.strict = False
    out["crossed, relaxed"] = _exchange(relaxed, rank, send_first=True)
    try:  # last: the timed-out sends stay posted
        _exchange(PeerMessages(ps, torch.device("cpu"), TIMEOUT), rank, send_first=True)
    except PipelineTimeout as error:
        out["crossed, strict"] = str(error)
    return out


def test_strict_transport_holds_peer_messages_to_nccls_pair_order():
    results = run_distributed(2, _checks, timeout=120)
    for rank, out in enumerate(results):
        assert out["strict"]  # the suite runs under the strict transport (tests/conftest.py)
        assert out["matched"] == out["crossed, relaxed"] == (torch.arange(3) + 10 * (1 - rank)).tolist()
    # the first rank to time out names the silent peer; gloo then closes that pair, so its peer may
    # instead see the connection lost, a sentence that sends the reader to the first rank's log
    timed_out = [out["crossed, strict"].startswith(
        f"rank {rank} (pipeline stage {rank}) waited more than 2 s on the send of the test tensor with global "
        f"rank {1 - rank}, which never answered;") for rank, out in enumerate(results)]
    assert any(timed_out)
    for rank, out in enumerate(results):
        assert timed_out[rank] or out["crossed, strict"].startswith(
            f"rank {rank} (pipeline stage {rank}) lost its connection to global rank {1 - rank} during the send of "
            "the test tensor: that rank stopped first; its log names the cause.")
