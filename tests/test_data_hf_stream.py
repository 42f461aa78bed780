"""``--hf-dataset``: streamed windows against ``GPTDataset``'s over the same text preprocessed to .bin/.idx;
the position of any sample found from its index alone; the global stream dealt to data-parallel ranks;
one sentence for each bad dataset.

The reference cannot be wrong in the same way: ``preprocess`` (``--append-eod``) and ``GPTDataset`` build
the stream from an index of document lengths; the streamed path tokenises and packs as it reads."""

import json
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.cli.parse import parse_config
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.hf_source import open_hf_dataset
from megapipe.data.hf_stream import StreamedGPTDataset, build_streamed_datasets
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.preprocess import preprocess
from megapipe.data.samplers import build_pretraining_data_loader
from megapipe.data.tokenizer import build_tokenizer
from megapipe.data.tokenizing_pool import TokenizingPool
from megapipe.errors import ConfigError, DataError
from megapipe.optional import MissingPackage

datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.unit

BYTES = build_tokenizer("ByteLevelTokenizer")
POOL = TokenizingPool(BYTES, workers=0)  # the worker processes are the system test's (test_hf_stream_resume.py)
SEED = 7


def corpus(count: int = 150) -> list[str]:
    """Texts of varied length (0 to ~70 bytes, some empty), multi-byte characters included; more than one
    tokenising chunk of documents."""
    rng = np.random.default_rng(3)
    texts = [" ".join(["naïve", "word", "λ", "x"][int(k)] for k in rng.integers(0, 4, int(n)))
             for n in rng.integers(0, 18, count)]
    texts[4] = texts[count // 2 + 1] = ""
    return texts


def in_memory(texts: list[str], seq_length: int, num_samples: int = 10**6) -> StreamedGPTDataset:
    return StreamedGPTDataset(lambda indices: [texts[i] for i in indices], np.arange(len(texts)), num_samples,
                              seq_length, SEED, POOL)


def take(iterator, count: int) -> list[list[int]]:
    return [next(iterator).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The corpus in the three forms --hf-dataset reads, and its .bin/.idx preprocessed with --append-eod."""
    root, texts = tmp_path_factory.mktemp("hf"), corpus()
    table = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    table.save_to_disk(str(root / "saved"))
    (root / "jsonl").mkdir()  # two files, read in name order
    with open(root / "jsonl" / "part-0.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[:25])
    with open(root / "jsonl" / "part-1.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts[25:])
    (root / "parquet").mkdir()
    table.to_parquet(str(root / "parquet" / "data.parquet"))
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    prefix = preprocess([str(root / "corpus.jsonl")], str(root / "bin"), BYTES, append_eod=True, progress=False)["text"]
    return root, texts, IndexedDataset(prefix)


@pytest.mark.parametrize("form", ["saved", "jsonl", "parquet"])
@pytest.mark.parametrize("seq_length", [3, 16, 150])
def test_streamed_windows_are_gpt_dataset_stream_windows(saved, tmp_path, form, seq_length):
    """Windows 0..N-1 (several epochs) equal GPTDataset.sample_tokens(0..N-1) for the preprocessed text."""
    root, texts, indexed = saved
    dataset = open_hf_dataset(str(root / form), "text", cache_dir=str(tmp_path / "hf-cache"))
    streamed = StreamedGPTDataset(lambda i: dataset[i]["text"], np.arange(len(dataset)), 10**6, seq_length, SEED, POOL)
    count = 3 * sum(len(t.encode()) + 1 for t in texts if t) // seq_length  # about three epochs
    reference = GPTDataset(indexed, np.arange(len(texts)), count, seq_length, SEED, str(tmp_path / "index"))
    assert take(streamed.windows(0), count) == [reference.sample_tokens(j).tolist() for j in range(count)]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(any),
       seq_length=st.integers(1, 50), first=st.integers(0, 300))
def test_any_window_is_found_from_its_index(lengths, seq_length, first):
    """``windows(first)`` continues the stream read from 0 exactly at window ``first``, whether the document
    lengths are still to be counted (a fresh stream: a resumed run) or already known (arithmetic)."""
    texts = ["ab" * (n // 2) + "c" * (n % 2) for n in lengths]
    whole = take(in_memory(texts, seq_length).windows(0), first + 3)
    assert take(in_memory(texts, seq_length).windows(first), 3) == whole[first:]
    known = in_memory(texts, seq_length)
    known.locate(sum(lengths) + 2 * len(lengths))  # past the first epoch: every length counted
    assert (known._lengths >= 0).all()
    assert take(known.windows(first), 3) == whole[first:]


@pytest.mark.parametrize("dp_size, consumed", [(1, 0), (2, 0), (4, 0), (2, 24), (4, 8), (1, 40)])
def test_ranks_share_out_the_one_global_stream(dp_size, consumed):
    """Each global batch of micro-batch 2 x dp_size samples, from any consumed count, is dealt to the ranks
    in rank order: together they read windows consumed, consumed + 1, ... as one rank alone would."""
    texts, seq_length, micro = corpus(), 8, 2
    whole = take(in_memory(texts, seq_length).windows(0), 64)
    steps = (64 - consumed) // (micro * dp_size)
    per_rank = [list(build_pretraining_data_loader(in_memory(texts, seq_length, 64), consumed, micro, rank, dp_size))
                for rank in range(dp_size)]
    read = [sample for step in range(steps) for rank in range(dp_size)
            for sample in torch_rows(per_rank[rank][step])]
    assert read == [window[:-1] for window in whole[consumed:consumed + steps * micro * dp_size]]
    assert all(len(batches) == steps for batches in per_rank)


def torch_rows(batch: dict) -> list[list[int]]:
    assert (batch["labels"][:, :-1] == batch["tokens"][:, 1:]).all()
    return batch["tokens"].tolist()


def test_splits_take_contiguous_documents_and_refuse_an_empty_one():
    texts = corpus(20)
    read = lambda indices: [texts[i] for i in indices]  # noqa: E731
    train, valid, test = build_streamed_datasets(read, 20, "tiny", "80,10,10", 8, SEED, (5, 5, 0), POOL)
    assert train.documents.tolist() == list(range(16)) and valid.documents.tolist() == [16, 17] and test is None
    with pytest.raises(DataError, match=r"^--split 99,1,0 gives the valid split of tiny none of its 20 documents"):
        build_streamed_datasets(read, 20, "tiny", "99,1,0", 8, SEED, (5, 5, 0), POOL)


def test_a_split_of_empty_texts_is_one_sentence():
    with pytest.raises(DataError, match=r"^the train split of --hf-dataset has no tokens in its 3 documents "
                                        r"\(all texts are empty\); add text"):
        in_memory(["", "", ""], 4).windows(0).__next__()


def test_bad_datasets_are_one_sentence_each(saved, tmp_path):
    root = saved[0]
    cache = str(tmp_path / "hf-cache")
    cases = {
        "no text key": (str(root / "saved"), "body",
                        rf"^--hf-dataset {root / 'saved'} has no column 'body' \(its columns: text, id\); name the "
                        r"text column with --hf-dataset-text-key\.$"),
        "not text": (str(root / "saved"), "id", r"column 'id' holds int64, not text;"),
        "a file": (str(root / "corpus.jsonl"), "text", r"corpus.jsonl is not a folder; pass a folder written by "
                                                       r"Dataset.save_to_disk"),
        "missing": (str(root / "nowhere"), "text", r"nowhere is not a folder;"),
        "no data files": (str(tmp_path), "text", r"is not a dataset \(no Parquet, JSONL or Arrow files"),
    }
    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})) \
        .save_to_disk(str(tmp_path / "empty"))
    cases["empty"] = (str(tmp_path / "empty"), "text", r"empty holds no documents; add data or pass another dataset\.$")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dict"))
    cases["splits"] = (str(tmp_path / "dict"), "text", r"holds several splits \(train\); pass the folder of one of "
                                                       r"them, e\.g\. .*dict/train\.$")
    (tmp_path / "no-rows").mkdir()
    (tmp_path / "no-rows" / "a.jsonl").write_text("")
    cases["no rows"] = (str(tmp_path / "no-rows"), "text",
                        r"no-rows holds no documents \(its files are empty\); add data or pass another dataset\.$")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "a.parquet").write_bytes(b"not parquet")
    cases["unreadable"] = (str(tmp_path / "broken"), "text", r"broken cannot be read as a dataset \(")
    for name, (path, key, message) in cases.items():
        before = sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(DataError, match=message):
            open_hf_dataset(path, key, cache_dir=cache)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != "hf-cache") == \
            [n for n in before if n != "hf-cache"], f"{name}: a refused dataset left files behind"


@pytest.mark.parametrize("argv, message", [
    (["--hf-dataset", "d", "--data-path", "p"], "--hf-dataset replaces --data-path; drop one of them."),
    (["--hf-dataset", "d", "--mock-data", "--vocab-size", "8"], "--hf-dataset replaces --mock-data"),
    (["--num-workers", "-1"], "--num-workers -1 must be 0 or more"),
])
def test_flags_that_do_not_fit_are_one_sentence(argv, message):
    with pytest.raises(ConfigError, match="^" + message.replace(".", r"\.")):
        parse_config("gpt", argv)


def test_bert_and_a_missing_datasets_package_are_one_sentence(monkeypatch):
    with pytest.raises(ConfigError, match=r"^--hf-dataset makes GPT samples only; pretrain_bert\.py needs"):
        parse_config("bert", ["--hf-dataset", "d"])
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an image without the package gives
    with pytest.raises(MissingPackage, match=r"^--hf-dataset needs the datasets package, which is not installed"):
        parse_config("gpt", ["--hf-dataset", "d"])
