"""Convergence of PipeDream-Flush (1F1B), PipeDream-2BW and PipeDream on the same data.

    python benchmarks/convergence_async.py             # 2 stages, 320 batches of m = 2, 2 rates; ~10 minutes
    python benchmarks/convergence_async.py --quick     # 20 batches, a smoke test

A small GPT (4 layers, untied embeddings) trains on the corpus that ships inside Python
(``megapipe.data.corpus``), split into two pipeline stages (2 processes). All three runs
start from the same weights and see the same microbatches in the same order, with AdamW at
the same learning rate; the whole comparison runs at two learning rates, since staleness
costs more at a higher one. Flush and 2BW apply one update per batch of m microbatches (2BW
on 1-stale weights: W(t+1) = W(t) - lr grad f(W(t-1))); PipeDream one update per microbatch
on every stage (weight stashing: W(t+1) = W(t) - lr grad f(W_1(t-1), W_2(t)) for 2 stages),
so at equal learning rate it takes m times more, smaller steps. The x-axis is microbatches
trained; the curves are moving averages of the training loss; the held-out loss of every
run is measured at the end on the same validation microbatches (PipeDream and 2BW drained).
The plot goes to benchmarks/results/convergence_async.png.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from harness import cli, report
from megapipe.config import ModelConfig
from megapipe.data.corpus import cache_root, default_gpt_data
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.models import build_model_chunks
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

SCHEDULES = ("1f1b", "2bw", "pipedream")
RESULTS = report.RESULTS
P, M, SEQ, MICRO, VALID_MICROBATCHES, SMOOTH = 2, 2, 64, 8, 16, 40
LEARNING_RATES = (1e-3, 3e-4)


def datasets(batches: int):
    prefix, tokenizer = default_gpt_data()
    indexed = IndexedDataset(prefix)
    documents = np.arange(indexed.num_documents)
    cut = int(0.9 * len(documents))
    cache = os.path.join(cache_root(), "convergence_async")
    train = GPTDataset(indexed, documents[:cut], batches * M * MICRO, SEQ, 1234, cache, "train")
    valid = GPTDataset(indexed, documents[cut:], VALID_MICROBATCHES * MICRO, SEQ, 1234, cache, "valid")
    return train, valid, tokenizer.vocab_size


def microbatch(dataset: GPTDataset, index: int) -> dict:
    samples = [dataset[index * MICRO + j] for j in range(MICRO)]
    return {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}


def train(rank: int, world_size: int, batches: int) -> dict:
    train_data, valid_data, vocab = datasets(batches)
    config = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=vocab, seq_length=SEQ,
                         hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True)
    ps = ParallelState.initialize(pipeline=P)
    curves, held_out = {}, {}
    for lr, name in [(lr, name) for lr in LEARNING_RATES for name in SCHEDULES]:
        torch.manual_seed(0)
        chunks = build_model_chunks("gpt", config, ps, seed=1234)  # the same initial weights for every run
        engine = PipelineEngine(chunks, ps, OptimizerConfig(optimizer="adamw", lr=lr, weight_decay=0.0,
                                                            clip_grad=0.0), name, M, (SEQ, MICRO, config.hidden_size))
        losses = []
        for batch in range(batches):
            losses += engine.train_batch([microbatch(train_data, batch * M + j) for j in range(M)]).losses
        losses += engine.drain().losses
        valid = [microbatch(valid_data, i) for i in range(VALID_MICROBATCHES)]
        held = [loss for start in range(0, VALID_MICROBATCHES, M)
                for loss in engine.evaluate(valid[start:start + M]).losses]
        curves[(lr, name)] = losses
        held_out[(lr, name)] = float(np.mean(held)) if held else None
    return {"curves": curves, "held_out": held_out} if ps.is_last_stage else None


def smooth(values: list[float]) -> np.ndarray:
    kernel = np.ones(SMOOTH) / SMOOTH
    return np.convolve(values, kernel, mode="valid")


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--batches", type=int, default=320)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    batches = 20 if args.quick else args.batches
    result = next(r for r in run_distributed(P, train, batches, timeout=7200) if r is not None)
    lines = [f"GPT 4 layers, hidden 128, seq {SEQ}, micro batch {MICRO}, p={P}, m={M}, AdamW, "
             f"{batches * M} microbatches"]
    lines += report.markdown(["lr", "schedule", "updates per stage", "final train loss (mean of last 50 microbatches)",
                              "held-out loss"])
    for lr, name in [(lr, name) for lr in LEARNING_RATES for name in SCHEDULES]:
        curve = result["curves"][(lr, name)]
        updates = batches * M if name == "pipedream" else batches
        lines.append(f"| {lr:g} | {name} | {updates} | {np.mean(curve[-50:]):.4f} | "
                     f"{result['held_out'][(lr, name)]:.4f} |")
    print("\n".join(lines))
    if args.quick:
        return
    report.write_result("convergence_async", "Convergence of Flush, 2BW and PipeDream",
                        "python benchmarks/convergence_async.py", lines, note=", plot: convergence_async.png")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, len(LEARNING_RATES), figsize=(12, 4.5), sharey=True)
    for axes, lr in zip(panels, LEARNING_RATES):
        for name in SCHEDULES:
            curve = smooth(result["curves"][(lr, name)])
            axes.plot(np.arange(SMOOTH, SMOOTH + len(curve)), curve, label=name)
        axes.set_xlabel("microbatches trained")
        axes.set_title(f"AdamW lr={lr:g}")
        axes.legend()
    panels[0].set_ylabel(f"training loss (moving average of {SMOOTH})")
    figure.suptitle(f"GPT on the built-in corpus, p={P}, m={M}")
    figure.tight_layout()
    figure.savefig(os.path.join(RESULTS, "convergence_async.png"), dpi=120)


if __name__ == "__main__":
    main()
