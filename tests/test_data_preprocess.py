"""Preprocessing: JSONL, text and Parquet round trips, sentence splitting, workers, input errors."""

import json

import numpy as np
import pytest

from data_helpers import gpt2_files
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.preprocess import preprocess
from megapipe.data.sentences import split_sentences
from megapipe.data.tokenizer import Tokenizer, build_tokenizer
from megapipe.errors import ConfigError, DataError

DOCUMENTS = [
    "First document. It has two sentences!",
    "",
    "  Leading spaces,\ttabs, and\nnew lines\n\nafter a blank line. Émojis 🎉 and 日本語 too?  Yes.",
    "Dr. Smith met Mr. Jones, e.g. at 5 p.m. on Jan. 3. They spoke.",
    "a literal <|endoftext|> inside text",
]
BYTE_LEVEL = build_tokenizer("ByteLevelTokenizer")


def documents_of(prefix, tokenizer, drop_eod):
    ds = IndexedDataset(prefix, vocab_size=tokenizer.vocab_size)
    texts = []
    for d in range(ds.num_documents):
        ids = ds.document(d).tolist()
        if drop_eod and ids:
            assert ids[-1] == tokenizer.eod
            ids = ids[:-1]
        texts.append(tokenizer.detokenize(ids))
    return texts


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(params=["ByteLevelTokenizer", "GPT2BPETokenizer"])
def lossless_tokenizer(request):
    if request.param == "ByteLevelTokenizer":
        return BYTE_LEVEL
    vocab, merges = gpt2_files()
    return build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)


@pytest.mark.unit
def test_jsonl_round_trip_with_several_keys(tmp_path, lossless_tokenizer):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "title": t[:7], "id": i} for i, t in enumerate(DOCUMENTS)])
    prefixes = preprocess([path], str(tmp_path / "out"), lossless_tokenizer, json_keys=["text", "title"],
                          append_eod=True, progress=False)
    assert prefixes == {"text": str(tmp_path / "out_text_document"), "title": str(tmp_path / "out_title_document")}
    assert documents_of(prefixes["text"], lossless_tokenizer, drop_eod=True) == DOCUMENTS
    assert documents_of(prefixes["title"], lossless_tokenizer, drop_eod=True) == [t[:7] for t in DOCUMENTS]
    dtype = IndexedDataset(prefixes["text"]).dtype
    assert dtype == np.uint16  # 261 and 50,257 ids both fit


@pytest.mark.system
def test_workers_write_the_same_bytes_as_one_process(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t * (i + 1)} for i, t in enumerate(DOCUMENTS * 20)])
    one = preprocess([path], str(tmp_path / "one"), BYTE_LEVEL, append_eod=True, progress=False)["text"]
    two = preprocess([path], str(tmp_path / "two"), BYTE_LEVEL, append_eod=True, workers=2, progress=False)["text"]
    for suffix in (".bin", ".idx"):
        assert open(one + suffix, "rb").read() == open(two + suffix, "rb").read()


@pytest.mark.unit
def test_plain_text_one_document_per_line_or_per_file(tmp_path):
    lines = [d.replace("\n", " ") for d in DOCUMENTS if d]
    (tmp_path / "a.txt").write_text("\n".join(lines[:2]) + "\n\n   \n")
    (tmp_path / "b.txt").write_bytes("\r\n".join(lines[2:]).encode())  # Windows line endings
    inputs = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    per_line = preprocess(inputs, str(tmp_path / "lines"), BYTE_LEVEL, progress=False)["text"]
    assert documents_of(per_line, BYTE_LEVEL, drop_eod=False) == lines  # blank lines are not documents
    per_file = preprocess(inputs, str(tmp_path / "files"), BYTE_LEVEL, document_per_file=True, progress=False)["text"]
    assert documents_of(per_file, BYTE_LEVEL, drop_eod=False) == [open(p, "rb").read().decode() for p in inputs]


@pytest.mark.unit
def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"content": DOCUMENTS, "n": list(range(len(DOCUMENTS)))}), path)
    prefix = preprocess([path], str(tmp_path / "pq"), BYTE_LEVEL, json_keys=["content"], append_eod=True,
                        progress=False)["content"]
    assert documents_of(prefix, BYTE_LEVEL, drop_eod=True) == DOCUMENTS


@pytest.mark.unit
def test_split_sentences_gives_one_sequence_per_sentence(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in DOCUMENTS])
    prefix = preprocess([path], str(tmp_path / "out"), BYTE_LEVEL, split_sentences=True, append_eod=True,
                        progress=False)["text"]
    assert prefix.endswith("out_text_sentence")
    ds = IndexedDataset(prefix)
    assert documents_of(prefix, BYTE_LEVEL, drop_eod=True) == DOCUMENTS  # sentences keep every byte
    doc3 = [BYTE_LEVEL.detokenize(ds[i]) for i in range(ds.document_indices[3], ds.document_indices[4])]
    assert doc3 == ["Dr. Smith met Mr. Jones, e.g. at 5 p.m. on Jan. 3. ", "They spoke."]
    assert ds[int(ds.document_indices[4]) - 1][-1] == BYTE_LEVEL.eod  # eod ends the last sentence only


@pytest.mark.unit
@pytest.mark.parametrize("text, sentences", [
    ("One. Two? Three! Four", ["One. ", "Two? ", "Three! ", "Four"]),
    ('He said "Stop." Then left.', ['He said "Stop." ', "Then left."]),
    ("Lower case after a period. like this stays.", ["Lower case after a period. like this stays."]),
    ("Mr. Smith and J. Doe. Next", ["Mr. Smith and J. Doe. ", "Next"]),
    ("Heading\n\nBody text", ["Heading\n\n", "Body text"]),
    ("Pi is 3.14 exactly. Yes", ["Pi is 3.14 exactly. ", "Yes"]),
    ("   ", []),
])
def test_sentence_splitter_rules(text, sentences):
    assert split_sentences(text) == sentences


class WideTokenizer(Tokenizer):
    """One id per character, offset so that ids need more than 16 bits."""

    def __init__(self):
        super().__init__("WideTokenizer", {}, {"eod": 0})

    @property
    def vocab_size(self):
        return 70000 + 0x110000

    def tokenize(self, text):
        return [70000 + ord(c) for c in text]

    def detokenize(self, ids):
        return "".join(chr(i - 70000) for i in ids)

    def save(self, directory):
        return None


@pytest.mark.unit
def test_large_vocabularies_are_stored_as_int32(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in DOCUMENTS])
    tokenizer = WideTokenizer()
    prefix = preprocess([path], str(tmp_path / "wide"), tokenizer, progress=False)["text"]
    assert IndexedDataset(prefix).dtype == np.int32
    assert documents_of(prefix, tokenizer, drop_eod=False) == DOCUMENTS


@pytest.mark.unit
@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": "broken\n', r"in.jsonl:2 is not valid JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n',
     r"in.jsonl:2 has no key 'text' \(found: body\); pass the right field with --json-keys"),
    ('{"text": 5}\n', r"in.jsonl:1 key 'text' holds int, not text"),
    ('["text"]\n', r"in.jsonl:1 has no key 'text' \(found: list\)"),
])
def test_bad_jsonl_is_reported_with_file_and_line(tmp_path, content, message):
    (tmp_path / "in.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), BYTE_LEVEL, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing half-written is left


@pytest.mark.system
def test_input_errors_reach_the_caller_through_the_worker_pool(tmp_path):
    lines = [json.dumps({"text": f"document {i}"}) for i in range(200)] + ["{not json"]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="in.jsonl:201 is not valid JSON"):
        preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), BYTE_LEVEL, workers=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.unit
def test_other_input_errors(tmp_path):
    with pytest.raises(DataError, match="--input .*missing.jsonl does not exist"):
        preprocess([str(tmp_path / "missing.jsonl")], str(tmp_path / "out"), BYTE_LEVEL, progress=False)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match="is not UTF-8 text .bad byte at offset 3"):
        preprocess([str(tmp_path / "latin1.txt")], str(tmp_path / "out"), BYTE_LEVEL, progress=False)
    with pytest.raises(ConfigError, match="--json-keys title only applies to JSONL and Parquet input"):
        preprocess([str(tmp_path / "latin1.txt")], str(tmp_path / "out"), BYTE_LEVEL, json_keys=["title"])
    no_eod = build_tokenizer("BertWordPieceCase", vocab_file=str(write_vocab(tmp_path)))
    (tmp_path / "in.txt").write_text("a b\n")
    prefix = preprocess([str(tmp_path / "in.txt")], str(tmp_path / "bert"), no_eod, append_eod=True, progress=False)
    assert IndexedDataset(prefix["text"])[0].tolist()[-1] == no_eod.sep  # BERT's eod is [SEP]


def write_vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")
    return path
