"""Streamed tokenisation (``--hf-dataset``) against pre-tokenised ``.bin/.idx`` data, tokens per second of samples.

    python benchmarks/hf_streaming.py                          # ~4 MB of text, byte-level, workers 0 1 2
    python benchmarks/hf_streaming.py --quick                  # ~0.5 MB, one round: a smoke test
    python benchmarks/hf_streaming.py --tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M

The same text (the Python reference prose that ships with the interpreter, repeated in shuffled
paragraph orders to ``--megabytes``) is written once as a Hugging Face dataset (``save_to_disk``)
and once preprocessed to ``.bin/.idx`` with ``--append-eod``; neither preparation is timed. Then
each system reads the first ``--samples`` GPT samples of ``--seq-length`` through the loader the
training loop uses (``build_pretraining_data_loader``, micro-batch ``--micro-batch-size``, one
data-parallel rank): the pre-tokenised ``GPTDataset`` and the streamed dataset with 0 (the reading
process tokenises), 1 and 2 worker processes. The systems take turns, in an order rotated every
round; a row gives the median over rounds of the tokens/s (samples x seq_length per second, after
a warm-up microbatch that starts the worker pool), the median ratio to the pre-tokenised rate of
the same round, and the CPU time the reading process itself spent per million tokens: what
training would lose to reading, as the workers tokenise on cores of their own. The last line
times a resume: locating sample ``--samples`` in a fresh stream (which counts the tokens before
it).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time

import numpy as np

from harness import cli, report
from harness.pairing import take_turns, timed
from megapipe.data.corpus import corpus_paragraphs
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.hf_source import open_hf_dataset
from megapipe.data.hf_stream import StreamedGPTDataset
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.preprocess import preprocess
from megapipe.data.samplers import build_pretraining_data_loader
from megapipe.data.tokenizer.flags import add_tokenizer_arguments, tokenizer_from_args
from megapipe.data.tokenizing_pool import TokenizingPool
from megapipe.optional import require

PRETOKENISED = ".bin/.idx"
SEED = 1234


def write_text(folder: str, megabytes: float) -> list[str]:
    """Paragraphs of the reference prose, repeated in shuffled orders to ``megabytes``; written as JSONL too."""
    paragraphs, texts, rng = corpus_paragraphs(), [], random.Random(SEED)
    count = max(1, round(megabytes * 1e6 * len(paragraphs) / sum(len(p.encode()) for p in paragraphs)))
    while len(texts) < count:
        texts += rng.sample(paragraphs, len(paragraphs))
    texts = texts[:count]
    with open(os.path.join(folder, "text.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return texts


def read_samples(dataset, samples: int, micro_batch_size: int) -> tuple[float, float]:
    """Wall and this process's CPU seconds to read ``samples`` samples after one warm-up microbatch."""
    batches = iter(build_pretraining_data_loader(dataset, 0, micro_batch_size, 0, 1))
    next(batches)
    wall, cpu, _ = timed(lambda: [next(batches) for _ in range(samples // micro_batch_size - 1)], barriers=False)
    return wall, cpu


def main(argv=None) -> None:
    parser = cli.parser(__doc__, quick="~0.5 MB and one round: a smoke test", rounds=None,
                        rounds_help="rounds of every system (default 3, 1 with --quick)", json="write the rows here")
    parser.add_argument("--megabytes", type=float, default=None, help="text to generate (default 4, 0.5 with --quick)")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=None,
                        help="samples each system reads (default: as many as the text gives, less one microbatch)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="worker counts of the streamed rows")
    add_tokenizer_arguments(parser, required=False)
    args = parser.parse_args(argv)
    args.tokenizer_type = args.tokenizer_type or "ByteLevelTokenizer"
    tokenizer, rounds = tokenizer_from_args(args), cli.rounds_of(args, 3, quick=1)
    megabytes = args.megabytes or (0.5 if args.quick else 4.0)
    datasets = require("datasets", "benchmarks/hf_streaming.py")
    with tempfile.TemporaryDirectory() as folder:
        texts = write_text(folder, megabytes)
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(os.path.join(folder, "hf"))
        prefix = preprocess([os.path.join(folder, "text.jsonl")], os.path.join(folder, "bin"), tokenizer,
                            append_eod=True, progress=False)["text"]
        indexed = IndexedDataset(prefix)
        tokens = int(indexed.document_lengths.sum())
        samples = args.samples or (tokens // args.seq_length // args.micro_batch_size - 1) * args.micro_batch_size
        hf = open_hf_dataset(os.path.join(folder, "hf"), "text")
        documents = np.arange(len(texts))
        pools = {w: TokenizingPool(tokenizer, w) for w in args.workers}

        def system(name: str):
            if name == PRETOKENISED:
                return GPTDataset(indexed, documents, samples, args.seq_length, SEED, os.path.join(folder, "index"))
            return StreamedGPTDataset(lambda i: hf[i]["text"], documents, samples, args.seq_length, SEED,
                                      pools[int(name.split()[1])])

        names = [PRETOKENISED] + [f"streamed {w} worker{'s' if w != 1 else ''}" for w in args.workers]
        size = sum(len(t.encode()) for t in texts) / 1e6
        print(f"{len(texts):,} documents, {size:.2f} MB of text, {tokens:,} tokens ({tokenizer.name}); "
              f"{samples:,} samples of {args.seq_length} tokens, micro-batch {args.micro_batch_size}; {rounds} "
              f"round(s); {report.machine()}")
        timings = take_turns(names, rounds, lambda name, _: read_samples(system(name), samples, args.micro_batch_size))
        tokens_read = (samples // args.micro_batch_size - 1) * args.micro_batch_size * args.seq_length
        rate = {name: [tokens_read / wall for wall, _ in timings[name]] for name in names}
        rows = [(name, f"{statistics.median(rate[name]):,.0f}",
                 f"{statistics.median(r / p for r, p in zip(rate[name], rate[PRETOKENISED])):.3f}",
                 f"{statistics.median(cpu for _, cpu in timings[name]) / tokens_read * 1e6:.3f}") for name in names]
        report.print_markdown(["system", "tokens/s", f"ratio to {PRETOKENISED}",
                               "CPU s of the reading process per M tokens"], rows)
        fresh = system(names[-1])
        start = time.perf_counter()
        fresh.locate(samples * args.seq_length)
        print(f"\nresume at sample {samples:,}: {time.perf_counter() - start:.2f} s to locate it in a fresh stream "
              f"({names[-1]})")
        for pool in pools.values():
            pool.close()
        report.write_json(args.json, {"rows": rows, "tokens": tokens, "samples": samples, "rounds": rounds})


if __name__ == "__main__":
    sys.exit(main())
