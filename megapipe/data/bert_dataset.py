"""BERT samples: two spans of consecutive sentences, masked for the masked-LM loss, with a binary label.

Sample layout (``seq_length`` positions)::

    [CLS] A ... [SEP] B ... [SEP] [PAD] ...     types 0 for [CLS], A and the first [SEP], 1 for B and its [SEP]

A sample map, cached like the GPT index, packs each document's consecutive sentences into
chunks of a target length (``seq_length - 3`` tokens, or a random shorter target with
probability ``short_seq_prob``) holding at least two sentences; every epoch re-packs with new
targets and serves its chunks in a shuffled order. Item ``i`` then draws everything else from
``numpy.random.default_rng([seed, i])``, so it is the same in every run and rank:

* the chunk is cut at a random sentence boundary into A and B;
* ``pair_task="sop"`` (sentence order, Megatron's default): with probability 1/2, A and B are
  swapped and ``is_random`` is 1; ``"nsp"`` (next sentence): with probability 1/2, B is
  replaced by consecutive sentences from another document and ``is_random`` is 1;
* the longer span loses tokens at a random end until A and B fit the target;
* ``round(15%)`` of the A/B tokens (at least one) are chosen for prediction; of those, 80%
  become [MASK], 10% keep their token and 10% become a random non-special token.

Without ``binary_head`` the whole chunk is A, there is no B and ``is_random`` is 0.
"""

from __future__ import annotations

import numpy as np

from megapipe.data.index_cache import array_digest, load_or_build
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.tokenizer import Tokenizer
from megapipe.errors import ConfigError, DataError

INDEX_VERSION = 1
PAIR_TASKS = ("sop", "nsp")


def _pack_epoch(sentence_ranges: np.ndarray, sentence_lengths: np.ndarray, max_tokens: int, short_seq_prob: float,
                min_sentences: int, rng: np.random.Generator) -> list[tuple[int, int, int, int]]:
    """(document, first sentence, end sentence, target length) of every chunk of one epoch."""
    def new_target() -> int:
        return int(rng.integers(2, max_tokens + 1)) if rng.random() < short_seq_prob else max_tokens

    chunks = []
    for document, (first, end) in enumerate(sentence_ranges):
        start, tokens, target = first, 0, new_target()
        for sentence in range(first, end):
            tokens += int(sentence_lengths[sentence])
            count = sentence + 1 - start
            if count >= min_sentences and (tokens >= target or sentence == end - 1):
                chunks.append((document, start, sentence + 1, target))
                start, tokens, target = sentence + 1, 0, new_target()
    return chunks


def build_sample_map(sentence_ranges: np.ndarray, sentence_lengths: np.ndarray, num_samples: int, max_tokens: int,
                     short_seq_prob: float, min_sentences: int, seed: int) -> dict[str, np.ndarray]:
    """``num_samples`` rows of (document, first sentence, end sentence, target), epoch after shuffled epoch."""
    rng = np.random.default_rng(seed)
    epochs, total = [], 0
    while total < num_samples:
        chunks = np.asarray(_pack_epoch(sentence_ranges, sentence_lengths, max_tokens, short_seq_prob,
                                        min_sentences, rng), dtype=np.int64).reshape(-1, 4)
        if len(chunks) == 0:
            raise DataError(f"no document has {min_sentences} or more sentences, so no BERT sample can be made; "
                            "preprocess with --split-sentences and use documents of several sentences.")
        epochs.append(chunks[rng.permutation(len(chunks))])
        total += len(chunks)
    samples = np.concatenate(epochs)[:num_samples] if epochs else np.zeros((0, 4), np.int64)
    return {"samples": samples}


class BERTDataset:
    """``num_samples`` masked sentence-pair samples from the documents ``documents`` of a sentence dataset.

    Items are dicts: ``text``, ``types``, ``labels`` (-1 where not predicted), ``padding_mask``
    (1 = real token), all int64[seq_length]; ``loss_mask`` float32[seq_length]; ``is_random`` int64.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int, seq_length: int, seed: int,
                 cache_dir: str, tokenizer: Tokenizer, split_name: str = "train", masked_lm_prob: float = 0.15,
                 short_seq_prob: float = 0.1, binary_head: bool = True, pair_task: str = "sop"):
        if pair_task not in PAIR_TASKS:
            raise ConfigError(f"BERT pair task {pair_task} is unknown; "
                              "use sop (sentence order) or nsp (next sentence).")
        if seq_length < 5:
            raise ConfigError(f"--seq-length {seq_length} is too short for BERT; it needs at least 5 positions.")
        self.indexed = indexed
        self.seq_length, self.seed = seq_length, seed
        self.masked_lm_prob, self.binary_head, self.pair_task = masked_lm_prob, binary_head, pair_task
        self.cls, self.sep, self.mask, self.pad = tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad
        specials = np.fromiter(tokenizer.special_ids, dtype=np.int64)
        self.replacement_ids = np.setdiff1d(np.arange(tokenizer.vocab_size), specials)
        documents = np.asarray(documents, dtype=np.int64)
        self.sentence_ranges = np.stack([indexed.document_indices[documents],
                                         indexed.document_indices[documents + 1]], axis=1)
        self.nonempty_documents = np.flatnonzero(self.sentence_ranges[:, 1] > self.sentence_ranges[:, 0])
        if pair_task == "nsp" and binary_head and len(self.nonempty_documents) < 2:
            raise DataError(f"the {split_name} split of {indexed.prefix} has {len(self.nonempty_documents)} non-empty "
                            "document(s) but next-sentence prediction needs at least 2; use more data or the sop task.")
        max_tokens = seq_length - (3 if binary_head else 2)
        min_sentences = 2 if binary_head else 1
        description = {"kind": "bert", "version": INDEX_VERSION, "split": split_name, "seed": seed,
                       "max_tokens": max_tokens, "num_samples": num_samples, "short_seq_prob": short_seq_prob,
                       "min_sentences": min_sentences,
                       "structure": self._structure_digest()}
        index = load_or_build(cache_dir, description, lambda: build_sample_map(
            self.sentence_ranges, indexed.sequence_lengths, num_samples, max_tokens, short_seq_prob,
            min_sentences, seed))
        self.samples = index["samples"]

    def _structure_digest(self) -> str:
        """Hash of what the sample map depends on: the documents' sentence ranges and the sentence lengths."""
        ranges = self.sentence_ranges
        first, end = (int(ranges.min()), int(ranges.max())) if ranges.size else (0, 0)
        return array_digest(np.concatenate([ranges.ravel(), self.indexed.sequence_lengths[first:end]]))

    def __len__(self) -> int:
        return len(self.samples)

    def _sentences(self, first: int, end: int) -> list[np.ndarray]:
        return [np.asarray(self.indexed[s], dtype=np.int64) for s in range(first, end)]

    def _random_continuation(self, document: int, needed: int, rng: np.random.Generator) -> list[np.ndarray]:
        """Consecutive sentences, about ``needed`` tokens, from a random non-empty document other than ``document``."""
        others = self.nonempty_documents[self.nonempty_documents != document]
        first, end = (int(v) for v in self.sentence_ranges[others[rng.integers(len(others))]])
        start = int(rng.integers(first, end))
        span, tokens = [], 0
        for sentence in range(start, end):
            span.append(np.asarray(self.indexed[sentence], dtype=np.int64))
            tokens += len(span[-1])
            if tokens >= needed:
                break
        return span

    def _pair(self, i: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int, int]:
        document, first, end, target = (int(v) for v in self.samples[i])
        sentences = self._sentences(first, end)
        if not self.binary_head:
            return np.concatenate(sentences), np.zeros(0, np.int64), 0, target
        cut = int(rng.integers(1, len(sentences)))
        a, b = np.concatenate(sentences[:cut]), np.concatenate(sentences[cut:])
        is_random = int(rng.random() < 0.5)
        if is_random and self.pair_task == "sop":
            a, b = b, a
        elif is_random:
            b = np.concatenate(self._random_continuation(document, target - len(a), rng))
        return a, b, is_random, target

    @staticmethod
    def _truncate(a: np.ndarray, b: np.ndarray, max_tokens: int, rng: np.random.Generator):
        """Shorten the longer span (B on ties) one token at a time until both fit ``max_tokens``;
        each token comes off the front or the back with probability 1/2."""
        keep_a, keep_b = len(a), len(b)
        while keep_a + keep_b > max_tokens:
            if keep_a > keep_b:
                keep_a -= 1
            else:
                keep_b -= 1
        trimmed = []
        for span, keep in ((a, keep_a), (b, keep_b)):
            front = int(rng.binomial(len(span) - keep, 0.5))
            trimmed.append(span[front:front + keep])
        return trimmed

    def _mask(self, text: np.ndarray, candidates: np.ndarray, rng: np.random.Generator):
        """Choose positions to predict and corrupt them 80/10/10; returns the new text and the labels."""
        count = max(1, int(round(len(candidates) * self.masked_lm_prob)))
        chosen = np.sort(rng.choice(candidates, size=min(count, len(candidates)), replace=False))
        labels = np.full(len(text), -1, dtype=np.int64)
        labels[chosen] = text[chosen]
        draw = rng.random(len(chosen))
        random_ids = self.replacement_ids[rng.integers(len(self.replacement_ids), size=len(chosen))]
        text = text.copy()
        text[chosen] = np.where(draw < 0.8, self.mask, np.where(draw < 0.9, text[chosen], random_ids))
        return text, labels

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(i)])
        a, b, is_random, target = self._pair(int(i), rng)
        a, b = self._truncate(a, b, target, rng)
        second = [b, [self.sep]] if len(b) else []
        text = np.concatenate([[self.cls], a, [self.sep], *second]).astype(np.int64)
        types = np.concatenate([np.zeros(len(a) + 2, np.int64), np.ones(len(text) - len(a) - 2, np.int64)])
        special = np.zeros(len(text), dtype=bool)
        special[[0, len(a) + 1, -1]] = True
        text, labels = self._mask(text, np.flatnonzero(~special), rng)
        padding = self.seq_length - len(text)
        return {
            "text": np.concatenate([text, np.full(padding, self.pad, np.int64)]),
            "types": np.concatenate([types, np.zeros(padding, np.int64)]),
            "labels": np.concatenate([labels, np.full(padding, -1, np.int64)]),
            "is_random": np.int64(is_random),
            "loss_mask": np.concatenate([(labels >= 0).astype(np.float32), np.zeros(padding, np.float32)]),
            "padding_mask": np.concatenate([np.ones(len(text), np.int64), np.zeros(padding, np.int64)]),
        }
