"""Stage-to-stage messages: scatter/gather changes bytes, not results; a silent peer is named."""

import datetime

import pytest
import torch
import torch.distributed as dist

from megapipe.errors import PipelineTimeout
from megapipe.models import build_model_chunks
from megapipe.models.state_dict import canonical_state_dict, local_state_dict
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

from test_pipeline_training import MICRO, SEQ, microbatch, model_config, optimizer_config

pytestmark = pytest.mark.distributed

M = 4


def train_twice(rank, world_size):
    """t=2, p=2: the same two steps with scatter/gather on and off."""
    config = model_config("gpt")
    single = ParallelState.single()
    initial = canonical_state_dict(build_model_chunks("gpt", config, single), single, config)
    results = {}
    for scatter_gather in (True, False):
        ps = ParallelState.initialize(tensor=2, pipeline=2)
        chunks = build_model_chunks("gpt", config, ps)
        chunks[0].load_state_dict(local_state_dict(initial, chunks[0], ps, config))
        engine = PipelineEngine(chunks, ps, optimizer_config(), "1f1b", M, (SEQ, MICRO, config.hidden_size),
                                scatter_gather=scatter_gather)
        losses = [engine.train_batch([microbatch("gpt", config, step, i) for i in range(M)]).losses
                  for step in range(2)]
        params = [p.detach().clone() for p in chunks[0].parameters()]
        results[scatter_gather] = (losses, params, engine.executor.p2p.bytes_sent,
                                   engine.executor.p2p.messages_sent)
    (losses_on, params_on, bytes_on, msgs_on), (losses_off, params_off, bytes_off, msgs_off) = \
        results[True], results[False]
    # the all-gathered slices are the exact tensor that was split: results are bit-identical
    assert losses_on == losses_off
    assert all(torch.equal(a, b) for a, b in zip(params_on, params_off))
    assert msgs_on == msgs_off and msgs_on > 0
    assert bytes_on * 2 == bytes_off, (bytes_on, bytes_off)
    expected_message = SEQ * MICRO * config.hidden_size * 4  # fp32 boundary tensor
    assert bytes_off == msgs_off * expected_message
    return bytes_on, bytes_off


def test_scatter_gather_same_results_and_t_times_fewer_bytes():
    run_distributed(4, train_twice, timeout=240)


def silent_peer(rank, world_size):
    """Rank 0 never runs its schedule; rank 1 must fail naming what it waited for."""
    config = model_config("gpt")
    side = dist.new_group([0, 1])  # its own connections: a p2p timeout closes the pipeline's, not these
    ps = ParallelState.initialize(pipeline=2)
    chunks = build_model_chunks("gpt", config, ps)
    engine = PipelineEngine(chunks, ps, optimizer_config(), "1f1b", M, (SEQ, MICRO, config.hidden_size),
                            timeout=datetime.timedelta(seconds=3))
    message = None
    if rank == 1:
        with pytest.raises(PipelineTimeout) as error:
            engine.train_batch([microbatch("gpt", config, 0, i) for i in range(M)])
        message = str(error.value)
    dist.barrier(group=side)  # rank 0 waits here, never sending, until rank 1 has given up
    return message


def test_silent_peer_is_named_instead_of_hanging():
    message = run_distributed(2, silent_peer, timeout=120)[1]
    assert "rank 1 (pipeline stage 1)" in message
    assert "RECV_F1.0<0" in message and "global rank 0" in message
