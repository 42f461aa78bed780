"""Datasets move both ways between Megatron-LM and megapipe: megatron-core's own builder writes what megapipe
reads (GPT documents and BERT sentences, several dtypes) and trains on; megapipe's preprocess_data output
is read back by megatron-core's own ``IndexedDataset`` with identical tokens and documents."""

import json

import numpy as np
import pytest
import torch

from data_helpers import random_documents, write_dataset
from megapipe.config import ModelConfig
from megapipe.data.bert_dataset import BERTDataset
from megapipe.data.builder import build_train_valid_test_datasets
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.preprocess import preprocess
from megapipe.data.samplers import build_pretraining_data_loader
from megapipe.data.tokenizer import build_tokenizer
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState

pytestmark = pytest.mark.unit

megatron_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
BYTE_LEVEL = build_tokenizer("ByteLevelTokenizer")


def megatron_writes(prefix, documents, dtype):
    """Write ``documents`` (lists of sequences) with megatron-core's IndexedDatasetBuilder, as its
    preprocess_data.py does: one ``add_document`` per document with the lengths of its sequences."""
    builder = megatron_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for sequences in documents:
        builder.add_document(torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
                             [len(s) for s in sequences])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def documents():
    rng = np.random.default_rng(3)
    gpt = random_documents(rng, count=40, max_sequences=1, max_length=30, vocab=BYTE_LEVEL.vocab_size)
    bert = random_documents(rng, count=30, max_sequences=5, max_length=12, vocab=BYTE_LEVEL.vocab_size,
                            min_sequences=2)
    return {"gpt": gpt, "bert": bert}


@pytest.mark.parametrize("kind, dtype", [("gpt", np.uint16), ("gpt", np.int32), ("bert", np.uint16),
                                         ("bert", np.int64)])
def test_megatron_core_datasets_read_identically(tmp_path, documents, kind, dtype):
    docs = documents[kind]
    prefix = megatron_writes(str(tmp_path / kind), docs, dtype)
    ds = IndexedDataset(prefix, vocab_size=BYTE_LEVEL.vocab_size)
    assert (ds.format, ds.dtype, ds.num_documents) == ("megatron", np.dtype(dtype), len(docs))
    assert [ds[i].tolist() for i in range(len(ds))] == [s for doc in docs for s in doc]
    assert [ds.document(d).tolist() for d in range(len(docs))] == [sum(doc, []) for doc in docs]
    assert ds.document_indices.tolist() == np.cumsum([0] + [len(doc) for doc in docs]).tolist()


def test_megapipe_trains_on_megatron_core_data(tmp_path, documents):
    """GPT: a tiny model's loss on the first batch falls over a few steps; BERT: samples come out whole."""
    gpt = IndexedDataset(megatron_writes(str(tmp_path / "gpt"), documents["gpt"], np.uint16))
    samples = GPTDataset(gpt, np.arange(gpt.num_documents), 8, 16, seed=1, cache_dir=str(tmp_path / "c"))
    batch = next(iter(build_pretraining_data_loader(samples, 0, 4, 0, 1)))
    torch.manual_seed(0)
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=BYTE_LEVEL.vocab_size,
                         seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
    model = build_model_chunks("gpt", config, ParallelState.single())[0]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = model(None, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]

    bert = IndexedDataset(megatron_writes(str(tmp_path / "bert"), documents["bert"], np.int32))
    pairs = BERTDataset(bert, np.arange(bert.num_documents), 6, 32, seed=1, cache_dir=str(tmp_path / "c"),
                        tokenizer=BYTE_LEVEL)
    sample = pairs[0]
    assert sample["text"][0] == BYTE_LEVEL.cls and BYTE_LEVEL.sep in sample["text"].tolist()


def test_a_blend_mixes_megatron_core_and_megapipe_datasets(tmp_path, documents):
    docs = documents["gpt"]
    theirs = megatron_writes(str(tmp_path / "theirs"), docs[:20], np.int32)
    ours = write_dataset(str(tmp_path / "ours"), docs[20:], np.uint16, "megapipe")
    train, _, _ = build_train_valid_test_datasets("gpt", ["0.5", theirs, "0.5", ours], "1", 8, 1, (40, 0, 0),
                                                  BYTE_LEVEL, cache_dir=str(tmp_path / "c"))
    assert [part.indexed.format for part in train.datasets] == ["megatron", "megapipe"]
    assert len(train) == 40 and set(train.dataset_index.tolist()) == {0, 1}
    for part, prefix, part_docs in zip(train.datasets, (theirs, ours), (docs[:20], docs[20:])):
        read = IndexedDataset(prefix)
        assert [read.document(d).tolist() for d in range(read.num_documents)] == [sum(d, []) for d in part_docs]


@pytest.mark.parametrize("split", [False, True])
def test_preprocess_output_reads_identically_in_megatron_core(tmp_path, split):
    texts = ["First document. It has two sentences!", "Émojis 🎉 and 日本語. Second one?", "Third."]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = preprocess([str(source)], str(tmp_path / "out"), BYTE_LEVEL, split_sentences=split,
                        append_eod=True, progress=False)["text"]
    theirs = megatron_indexed.IndexedDataset(prefix)
    ours = IndexedDataset(prefix)
    assert len(theirs) == len(ours) and theirs.document_indices.tolist() == ours.document_indices.tolist()
    assert [theirs[i].tolist() for i in range(len(theirs))] == [ours[i].tolist() for i in range(len(ours))]
    documents = [np.concatenate([theirs[i] for i in range(start, end)]).tolist()
                 for start, end in zip(theirs.document_indices[:-1], theirs.document_indices[1:])]
    assert [BYTE_LEVEL.detokenize(ids[:-1]) for ids in documents] == texts
