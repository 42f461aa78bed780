"""What the pipeline runtime costs beyond the maths: host synchronisations and held activations.

* Host synchronisations are counted by patching every ``Tensor`` method that reads a value to
  the host (``distributed.count_synchronisations``); on an accelerator each is a stall of the
  device queue. A training step must make none, whatever the number of microbatches m
  (``test_iteration_syncs.py`` counts the training loop's whole iteration).
* Held activation bytes are counted from the tensors themselves: autograd's saved tensors (seen
  by ``torch.autograd.graph.saved_tensors_hooks``) of every microbatch still waiting for its
  backward, plus the stage outputs the executor keeps for those backwards, as unique storages.
  Freeing a sent output's data must lower the peak by exactly one boundary tensor per forward in
  flight whose output was sent: at the peak the newest forward's output is not sent yet, so by
  (forwards in flight - 1) boundary tensors (less the one-element placeholder each keeps).
"""

import pytest
import torch

from megapipe.parallel.launch import count_synchronisations
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

from test_pipeline_training import MICRO, SEQ, microbatch, model_config, optimizer_config


def _reads_per_step(m: int) -> int:
    config = model_config("gpt")
    ps = ParallelState.single()
    chunks = build_model_chunks("gpt", config, ps)
    engine = PipelineEngine(chunks, ps, optimizer_config(), "1f1b", m, (SEQ, MICRO, config.hidden_size))
    engine.train_batch([microbatch("gpt", config, 0, i) for i in range(m)])  # warm-up (lazy state)
    batch = [microbatch("gpt", config, 1, i) for i in range(m)]
    results = []
    reads = count_synchronisations(lambda: results.append(engine.train_batch(batch)), 1, torch.device("cpu"))
    assert len(results[0].batch.loss_tensors) == m
    return reads


@pytest.mark.unit
def test_host_reads_per_step_do_not_grow_with_microbatches():
    # none at all here: losses stay on the device and torch's fused AdamW (CPU and CUDA) takes the
    # skip flag on the device; a kernel without that support would read the flag once per step
    assert _reads_per_step(2) == _reads_per_step(8) == 0


def held_bytes_run(rank, world_size, deallocate: bool):
    """p = 2, 1F1B, m = 4: peak bytes the first stage holds for microbatches awaiting their backward."""
    config = model_config("gpt")
    ps = ParallelState.initialize(pipeline=2)
    torch.manual_seed(0)
    chunks = build_model_chunks("gpt", config, ps)
    engine = PipelineEngine(chunks, ps, optimizer_config(), "1f1b", 4, (SEQ, MICRO, config.hidden_size))
    engine.executor.deallocate_sent_outputs = deallocate
    saved_by: dict = {}  # (stage, microbatch) -> saved tensors of its forward
    current = []
    peak = [0, 0]  # bytes, forwards in flight at that peak
    executor = engine.executor
    original_run_forward = executor._run_forward

    def held() -> int:
        storages = {}
        for key, record in executor.state.saved.items():
            for tensor in saved_by.get(key, []) + [record.out]:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def run_forward(stage, microbatch, *args):
        current.append((stage, microbatch))
        out = original_run_forward(stage, microbatch, *args)
        current.pop()
        return out

    def pack(tensor):
        if current:
            saved_by.setdefault(current[-1], []).append(tensor)
        return tensor

    def after_action(*args):
        now = held()
        if now > peak[0]:
            peak[:] = [now, len(executor.state.saved)]

    executor._run_forward = run_forward
    original_compute = executor._compute

    def compute(*args):
        original_compute(*args)
        after_action()

    executor._compute = compute
    original_post = executor._post

    def post(*args):
        original_post(*args)
        after_action()

    executor._post = post
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        losses = engine.train_batch([microbatch("gpt", config, 0, i) for i in range(4)]).losses
    boundary = SEQ * MICRO * config.hidden_size * 4
    return peak, boundary, losses


def held_bytes_runs(rank, world_size):
    """Both runs of ``held_bytes_run`` in one world (each builds its own groups, model and engine
    from the same seed): sent outputs kept, then freed."""
    return [held_bytes_run(rank, world_size, deallocate) for deallocate in (False, True)]


@pytest.mark.distributed
def test_freeing_sent_outputs_lowers_held_bytes_by_one_boundary_tensor_per_forward_in_flight():
    kept, freed = zip(*run_distributed(2, held_bytes_runs, timeout=240))
    (peak_kept, in_flight_kept), boundary, losses_kept = kept[0]
    (peak_freed, in_flight_freed), _, losses_freed = freed[0]
    assert in_flight_kept == in_flight_freed == 2  # 1F1B at p = 2: the first stage holds two forwards
    # a freed output keeps a one-element fp32 placeholder (4 bytes) instead of its boundary tensor
    assert peak_kept - peak_freed == (in_flight_kept - 1) * (boundary - 4)
    assert kept[1][2] == freed[1][2]  # the last stage's losses: the same maths either way
    assert losses_kept == losses_freed == []
