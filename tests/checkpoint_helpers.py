"""Tiny GPT runs through the real Trainer for the checkpoint tests (inside ``run_distributed`` worlds), and the
conversion tool as a module."""

from __future__ import annotations

import importlib.util
import os

import torch.distributed as dist

from megapipe.cli.parse import parse_run
from megapipe.training.trainer import Trainer

# 4 layers so every pipeline split (p = 1, 2, 4; v = 2) fits; vocabulary padded to multiples of
# 16 x t, so tensor-parallel slices hold padding rows that a checkpoint must trim and restore.
# One evaluation batch at the end: it also drains PipeDream/2BW pipelines before the next run.
TINY_GPT = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "1", "--fusion-backend", "eager",
            "--make-vocab-size-divisible-by", "16", "--lr-warmup-iters", "1"]


def session_cache(tmp_path_factory) -> str:
    """One data cache for every checkpoint test of a session, so the corpus and its indices are built once."""
    return str(tmp_path_factory.getbasetemp() / "checkpoint-data-cache")


def layout_flags(t: int, p: int, schedule: str = "1f1b") -> list[str]:
    flags = ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size", str(p),
             "--pipeline-schedule", schedule]
    if schedule in ("interleaved", "zbv"):  # two chunks of one layer per rank, looped or in a V
        flags += ["--num-layers-per-virtual-pipeline-stage", "1"]
    if schedule in ("pipedream", "2bw"):  # stages update at different times: no tied copy to keep equal
        flags += ["--untie-embeddings-and-output-weights"]
    return flags


def build(argv: list[str], cache: str) -> Trainer:
    """The Trainer ``pretrain_gpt.py TINY_GPT + argv`` builds in this world (not yet trained)."""
    plan = parse_run("gpt", TINY_GPT + argv + ["--data-cache-path", cache], world_size=dist.get_world_size())
    return Trainer(plan)


def train(argv: list[str], cache: str, after_load=None) -> tuple[Trainer, list[list[float]]]:
    """Run ``pretrain_gpt.py TINY_GPT + argv`` in this world; the per-microbatch losses of every training call.

    ``after_load(trainer)``, if given, is called right after ``--load`` has restored the checkpoint.
    """
    trainer = build(argv, cache)
    if after_load is not None:
        load = trainer.checkpointer.load

        def loading(directory):
            load(directory)
            after_load(trainer)
        trainer.checkpointer.load = loading
    losses = []
    train_batch = trainer.engine.train_batch

    def recording(microbatches):
        result = train_batch(microbatches)
        losses.append(result.losses)
        return result

    trainer.engine.train_batch = recording
    trainer.train()
    return trainer, losses


def convert_tool():
    """``tools/convert_checkpoint.py`` as a module, so a test calls its ``main`` in this process."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "convert_checkpoint.py")
    spec = importlib.util.spec_from_file_location("convert_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
