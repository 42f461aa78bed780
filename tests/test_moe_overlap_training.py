"""``--overlap-moe-expert-parallel-comm`` at e = 2 on four ranks (1F1B at p = 1, d = 4; DualPipeV at p = 2,
d = 2): the losses and the updated weights equal those with the overlap off bit for bit, and the recorded
timeline shows one microbatch's expert all-to-all while the other microbatch of its pair computes. The
gradients are reduced during the backwards, and under 1F1B the weights are sharded and gathered around
every pass (optim_grads_params). With stand-in streams in the executor, every pass that took the side stream
marks each tensor it receives and hands on for the other stream (``pipeline/streams.py``)."""

import contextlib
import datetime

import pytest
import torch
from test_moe_layer import moe_config

from megapipe.config import OptimizerConfig
from megapipe.layout.placement import Placement
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.schedules.analysis.timeline import Timeline
from megapipe.pipeline import executor
from megapipe.pipeline.engine import PipelineEngine
from megapipe.pipeline.streams import PassStreams
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

# name: (schedule, pipeline ranks, placement, sharding level); under 1F1B both passes of each pair use the one
# chunk, whose weights are gathered before each pass and released after
CASES = {"1f1b": ("1f1b", 1, Placement.LOOPED, "optim_grads_params"),
         "dualpipev": ("dualpipev", 2, Placement.V, "no_shard")}


def _microbatches(config, replica: int) -> list[dict]:
    g = torch.Generator().manual_seed(11 + replica)
    return [{"tokens": torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g),
             "labels": torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g),
             "loss_mask": torch.ones(2, config.seq_length)} for _ in range(4)]


def _train(config, ps: ParallelState, schedule: str, sharding: str, overlap: bool, timeline=None):
    """One batch with SGD at learning rate 1 (reducing and gathering during the passes): the losses and every
    weight after the step."""
    sgd = OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0, overlap_grad_reduce=True,
                          data_parallel_sharding_strategy=sharding, overlap_param_gather=sharding != "no_shard")
    engine = PipelineEngine(build_model_chunks("gpt", config, ps), ps, sgd, schedule, 4,
                            (config.seq_length, 2, config.hidden_size), timeout=datetime.timedelta(seconds=60),
                            timeline=timeline, overlap_moe_comm=overlap)
    result = engine.train_batch(_microbatches(config, ps.dp_rank))
    with engine.whole_weights():
        weights = [p.detach().clone() for chunk in engine.chunks for p in chunk.parameters()]
    return result.batch.loss_tensors, weights


class _Stream:
    def wait_stream(self, other) -> None:
        pass


class RecordingStreams(PassStreams):
    """The executor's streams with stand-ins on the CPU: how often each side-stream pass marks tensors for the
    other stream, as (stage, microbatch, "in" or "out") -> marks."""

    made: list["RecordingStreams"] = []

    def __init__(self, device):
        super().__init__(device, main=_Stream(), side=_Stream(), use=lambda stream: contextlib.nullcontext())
        self.marked: dict = {}
        self.sides: set = set()
        RecordingStreams.made.append(self)

    def _record(self, key, tensors, reader) -> None:
        if key in self._on_side:
            self.sides.add(key)
            side = (*key, "in" if reader is self.side else "out")
            self.marked[side] = self.marked.get(side, 0) + any(isinstance(t, torch.Tensor) for t in tensors)


def _side_marks_complete(streams: "RecordingStreams", last_stage: int) -> bool:
    """Every pass that ran on the side stream marked its inputs (the received activation, the batch, the received
    gradient) and its outputs (activation or loss, input gradient), each where its stage has one."""
    for stage, microbatch in streams.sides:
        into = streams.marked.get((stage, microbatch, "in"), 0)
        out = streams.marked.get((stage, microbatch, "out"), 0)
        if into != (stage > 0) + 1 + (stage < last_stage) or out != 1 + (stage > 0):
            return False
    return bool(streams.sides)


def _compare(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    executor.PassStreams = RecordingStreams
    out = {}
    for name, (schedule, pipeline, placement, sharding) in CASES.items():
        config = moe_config(num_layers=4)
        ps = ParallelState.initialize(pipeline=pipeline, expert=2, placement=placement,
                                      virtual_pipeline=2 if placement is Placement.V else 1)
        timeline = Timeline()
        off = _train(config, ps, schedule, sharding, overlap=False)
        RecordingStreams.made.clear()
        on = _train(config, ps, schedule, sharding, overlap=True, timeline=timeline)
        training = RecordingStreams.made[0]  # the engine's training executor (its evaluation one comes next)
        marks_complete = _side_marks_complete(training, 2 * pipeline - 1 if pipeline > 1 else 0)
        same_losses = len(off[0]) == len(on[0]) and all(torch.equal(a, b) for a, b in zip(off[0], on[0]))
        same_weights = all(torch.equal(a, b) for a, b in zip(off[1], on[1]))
        pairs = sum(e.action.overlapped for e in timeline.events if e.phase is None)
        out[name] = (same_losses, same_weights, len(off[0]), pairs, timeline.hidden_phases()[0], marks_complete)
    return out


def test_overlap_equals_overlap_off_bit_for_bit_and_hides_the_all_to_all():
    results = run_distributed(4, _compare, timeout=240)
    for rank, result in enumerate(results):
        for name, (same_losses, same_weights, losses, pairs, hidden, marks_complete) in result.items():
            assert same_losses and same_weights, (rank, name)
            assert marks_complete, (rank, name)  # with stand-in streams: a pair's passes hand over marked tensors
            if pairs:  # a rank with overlapped pairs shows an all-to-all beside the other pass's compute
                assert hidden > 0, (rank, name)
    # DualPipeV's ranks d + 2 p: the V's end, with the losses, is on pipeline rank 0
    assert all(results[r]["1f1b"][2] == 4 for r in range(4)) and results[0]["dualpipev"][2] == 4
    assert all(results[r][name][3] > 0 for r in range(4) for name in CASES)  # every rank has pairs
