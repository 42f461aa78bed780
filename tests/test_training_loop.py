"""The training loop in-process: fp16 loss scaling survives an overflow; FLOP counts are exact; device
peaks for model FLOPs utilisation."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megapipe.cli.parse import parse_run
from megapipe.config import ModelConfig
from megapipe.models.flops import device_peak_tflops, flops_per_iteration
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

FP16_FLAGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--log-interval", "1",
              "--eval-interval", "100", "--eval-iters", "1", "--fp16", "--initial-loss-scale", "1024",
              "--hysteresis", "1", "--lr-warmup-iters", "0"]


def fp16_with_overflow(rank, world_size, cache):
    import os

    os.environ["MEGAPIPE_CACHE"] = cache
    from megapipe.training.trainer import Trainer

    trainer = Trainer(parse_run("gpt", FP16_FLAGS))
    fc1 = trainer.chunks[0].layers["0"].mlp.fc1
    record = []
    original = trainer.engine.train_batch

    def poison(module, args, output):
        """fc1's output gradient made infinite: its weight gradient, accumulated straight into the fp32
        main gradient (no ``.grad`` to hook), is infinite too."""
        product = output[0] if isinstance(output, tuple) else output
        product.register_hook(lambda g: torch.full_like(g, math.inf))

    def train_batch(microbatches):
        before = [p.detach().clone() for p in trainer.engine.optimizer.main_params]
        inject = len(record) == 2  # the third iteration gets an infinite gradient
        handle = fc1.register_forward_hook(poison) if inject else None
        result = original(microbatches)
        if handle is not None:
            handle.remove()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, trainer.engine.optimizer.main_params))
        record.append((result.step.ok, trainer.engine.optimizer.loss_scale, unchanged,
                       all(math.isfinite(x) for x in result.losses)))
        return result

    trainer.engine.train_batch = train_batch
    trainer.train()
    return record, trainer.state.skipped_iterations


@pytest.mark.distributed
def test_fp16_overflow_skips_the_step_halves_the_scale_and_continues(tmp_path):
    record, skipped = run_distributed(1, fp16_with_overflow, str(tmp_path), timeout=240)[0]
    oks = [ok for ok, _, _, _ in record]
    scales = [scale for _, scale, _, _ in record]
    assert oks == [True, True, False, True, True, True] and skipped == 1
    assert scales[2] == scales[1] / 2  # --hysteresis 1: the first overflow halves the scale
    assert record[2][2] and not record[3][2]  # the skipped step left every weight as it was; the next one moved them
    assert all(finite for _, _, _, finite in record)


@pytest.mark.unit
def test_flop_formula_equals_counted_matmuls():
    """eq. 4.2's count (3 passes per layer plus the logit layer) against PyTorch's FLOP counter."""
    # explicit attention matmuls: PyTorch's counter has no entry for the CPU flash-attention kernel
    config = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=300, seq_length=24,
                         hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False)
    model = build_model_chunks("gpt", config, ParallelState.single())[0]
    tokens = torch.randint(0, config.vocab_size, (5, config.seq_length))
    with FlopCounterMode(display=False) as counter:
        loss = model(None, {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(5, config.seq_length)})
        loss.backward()
    assert counter.get_total_flops() == flops_per_iteration(config, global_batch_size=5, recompute=False)


@pytest.mark.unit
@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA B200", 2250.0), ("NVIDIA RTX 9999", None),
])
def test_device_peaks_are_looked_up_by_the_exact_part(name, peak):
    """Data-sheet dense bf16 peaks: an H100 PCIe is not an SXM part; an unknown GPU has none (MFU needs
    --device-peak-tflops then)."""
    assert device_peak_tflops(name) == peak
