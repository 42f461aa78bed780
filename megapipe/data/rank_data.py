"""The data of one rank of a parallel job: only the ranks whose layers read samples open datasets.

* Readers are tensor rank 0 of the first and of the last pipeline stage: they build (or find
  cached) the sample indices and open the dataset files.
* The other tensor ranks of those stages receive the same microbatches from their reader over
  the tensor group (Megatron's ``broadcast_data``).
* Middle stages receive only what their layers read: nothing for GPT; BERT's padding mask,
  broadcast by the first stage's reader over the model-parallel group. They never open a dataset.
* Indices are built once per node, by its lowest-numbered reader, behind a barrier; the other
  readers then find them in the cache.
* Under context parallelism every context rank of a replica reads (or receives) the same samples
  and keeps only its two chunks of each sequence (``data/context_batch.py``), cut before anything is
  broadcast or moved to the device.

Batches move to the device through pinned memory without blocking the host (``to_device``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megapipe.config import Config
from megapipe.data.builder import build_train_valid_test_datasets
from megapipe.data.context_batch import HOST_FIELDS, PER_SAMPLE_FIELDS, context_share
from megapipe.data.corpus import default_bert_data, default_gpt_data, unigram_entropy
from megapipe.data.hf_source import open_hf_dataset
from megapipe.data.hf_stream import build_streamed_datasets
from megapipe.data.mock import MockGPTDataset
from megapipe.data.packing import packing_of
from megapipe.data.tokenizer.null import NullTokenizer
from megapipe.data.samplers import build_pretraining_data_loader
from megapipe.data.splits import SPLIT_NAMES, parse_split
from megapipe.data.tokenizer import Tokenizer, build_tokenizer
from megapipe.data.tokenizer.build import check_tokenizer_files
from megapipe.data.tokenizing_pool import TokenizingPool
from megapipe.parallel.launch import to_device
from megapipe.errors import ConfigError
from megapipe.parallel.state import ParallelState

# kind -> the role of a model chunk -> the batch keys its layers read
FIELDS = {
    "gpt": {"first": ("tokens",), "middle": (), "last": ("labels", "loss_mask")},
    "bert": {"first": ("tokens", "types", "padding_mask"), "middle": ("padding_mask",),
             "last": ("padding_mask", "labels", "loss_mask", "is_random")},
}
FLOAT_FIELDS = ("loss_mask",)


def batch_fields(kind: str, config: Config) -> dict[str, tuple[str, ...]]:
    """The role of a model chunk -> the batch keys its layers read, with the packed documents' fields
    (``data/packing.py``): document ids in every layer (under context parallelism also the whole sequence's,
    on the host), reset positions where they are used (the embedding's learned positions on the first stage,
    RoPE in every layer)."""
    fields = {role: list(keys) for role, keys in FIELDS[kind].items()}
    rope = config.model.position_embedding_type == "rope"
    for role in fields if kind == "gpt" else ():
        if config.data.reset_position_ids and (role == "first" or rope):
            fields[role].append("position_ids")
        if config.data.reset_attention_mask:
            fields[role].append("document_ids")
            if config.parallel.context_parallel_size > 1:
                fields[role].append("sequence_documents")
    return {role: tuple(keys) for role, keys in fields.items()}


def stage_roles(ps: ParallelState) -> frozenset:
    """``first``, ``middle``, ``last``: the roles of the model chunks this rank holds."""
    num_stages = ps.virtual_stages
    roles = set()
    for s in ps.chunk_stages():
        roles |= {"first"} if s == 0 else set()
        roles |= {"last"} if s == num_stages - 1 else set()
        roles |= {"middle"} if 0 < s < num_stages - 1 else set()
    return frozenset(roles)


def _has_middle_only_ranks(ps: ParallelState) -> bool:
    """True when some pipeline rank holds neither the first nor the last stage."""
    return ps.num_stages >= 3


@dataclass
class RankData:
    """The tokenizer of a run and, on readers, its datasets (``None`` elsewhere)."""

    kind: str
    tokenizer: Tokenizer
    reads: bool
    fields: dict  # the role of a model chunk -> the batch keys it reads (``batch_fields``)
    datasets: tuple = (None, None, None)
    data_path: Optional[str] = None  # the first dataset prefix (None for --mock-data and --hf-dataset)
    split_exists: tuple = (True, True, True)  # the same on every rank, reader or not
    streamed: Optional[str] = None  # with --hf-dataset: what is streamed, and how

    def description(self) -> str:
        """What the data is, for the log line of the rank that logs (a reader: it opens the dataset)."""
        if self.streamed is not None:
            return self.streamed
        if self.data_path is None:
            return f"mock data of {self.tokenizer.vocab_size - 1} random token ids"
        return f"unigram entropy of the data {unigram_entropy(self.data_path):.4f} nats/token"


def build_rank_data(kind: str, config: Config, ps: ParallelState, num_samples: tuple) -> RankData:
    """Tokenizer everywhere, datasets on readers; collective over the world (one gather, one barrier)."""
    reads = ps.tp_rank == 0 and bool(stage_roles(ps) & {"first", "last"})
    builds = _first_reader_of_node(ps.rank, reads)
    data = _read(kind, config, num_samples) if builds else None
    if dist.is_initialized():
        dist.barrier()
    if data is None:
        data = _read(kind, config, num_samples) if reads else _tokenizer_only(kind, config, num_samples)
    return data


def _first_reader_of_node(rank: int, reads: bool) -> bool:
    """Whether this rank is the lowest-numbered reader on its host (the one that builds the indices)."""
    if not dist.is_initialized():
        return reads
    roles = [None] * dist.get_world_size()
    dist.all_gather_object(roles, (socket.gethostname(), reads))
    host = roles[rank][0]
    return reads and rank == min(r for r, (h, reader) in enumerate(roles) if h == host and reader)


def _split_exists(config: Config, num_samples: tuple) -> tuple:
    weights = [1.0] * 3 if config.data.mock_data else parse_split(config.data.split)
    return tuple(w > 0 and n > 0 for w, n in zip(weights, num_samples))


def run_tokenizer(kind: str, config: Config) -> Tokenizer:
    """The tokenizer every rank of this run uses (its vocabulary sizes the model)."""
    return _tokenizer_and_path(kind, config)[0]


def _tokenizer_and_path(kind: str, config: Config) -> tuple[Tokenizer, list[str]]:
    data = config.data
    if data.mock_data:
        return NullTokenizer(data.vocab_size), []
    if data.hf_dataset:
        return _flags_tokenizer(data), []
    if data.data_path:
        if data.tokenizer_type is None and kind == "bert":
            raise ConfigError("--data-path for BERT needs --tokenizer-type (e.g. BertWordPieceLowerCase with "
                              "--vocab-file) matching the tokenizer the data was preprocessed with.")
        return _flags_tokenizer(data), list(data.data_path)
    named = _flags_tokenizer(data) if data.tokenizer_type is not None else None  # the corpus in its tokens
    prefix, tokenizer = (default_gpt_data if kind == "gpt" else default_bert_data)(data.data_cache_path, named)
    return tokenizer, [prefix]


def check_tokenizer_flags(config: Config) -> None:
    """Refuse, before any process group, tokenizer flags that this run's data would not read: every
    file flag belongs to the --tokenizer-type given, and --mock-data reads no tokenizer."""
    data = config.data
    check_tokenizer_files(data.tokenizer_type, {"vocab_file": data.vocab_file, "merge_file": data.merge_file,
                                                "tokenizer_model": data.tokenizer_model})
    if data.mock_data and data.tokenizer_type not in (None, "NullTokenizer"):
        raise ConfigError(f"--mock-data draws random token ids below --vocab-size and reads no tokenizer, so "
                          f"--tokenizer-type {data.tokenizer_type} would be ignored; drop it, or drop --mock-data "
                          "to train on the embedded corpus (or --data-path) in its tokens.")
    if data.tokenizer_type == "NullTokenizer" and not (data.mock_data or data.data_path or data.hf_dataset):
        raise ConfigError("--tokenizer-type NullTokenizer reads text made of decimal token ids, and the embedded "
                          "corpus is prose; pass --data-path of a dataset preprocessed with it, or --mock-data.")


def _flags_tokenizer(data) -> Tokenizer:
    """The tokenizer the flags name (bytes by default)."""
    return build_tokenizer(data.tokenizer_type or "ByteLevelTokenizer", vocab_file=data.vocab_file,
                           merge_file=data.merge_file, tokenizer_model=data.tokenizer_model, vocab_size=data.vocab_size)


def _tokenizer_only(kind: str, config: Config, num_samples: tuple) -> RankData:
    tokenizer, _ = _tokenizer_and_path(kind, config)
    return RankData(kind, tokenizer, False, batch_fields(kind, config), split_exists=_split_exists(config, num_samples))


def _read(kind: str, config: Config, num_samples: tuple) -> RankData:
    tokenizer, data_path = _tokenizer_and_path(kind, config)
    t, exists = config.training, _split_exists(config, num_samples)
    fields, packing = batch_fields(kind, config), packing_of(config.data, tokenizer) if kind == "gpt" else None
    if config.data.mock_data:
        datasets = tuple(MockGPTDataset(n, config.model.seq_length, config.data.vocab_size, t.seed, name, packing)
                         if present else None for n, name, present in zip(num_samples, SPLIT_NAMES, exists))
        return RankData(kind, tokenizer, True, fields, datasets, None, exists)
    if config.data.hf_dataset:
        return _read_streamed(config, tokenizer, num_samples, exists, fields, packing)
    options = dict(packing=packing) if kind == "gpt" else dict(masked_lm_prob=config.data.mask_prob,
                                                                short_seq_prob=config.data.short_seq_prob,
                                                                binary_head=config.model.bert_binary_head)
    datasets = build_train_valid_test_datasets(kind, data_path, config.data.split, config.model.seq_length, t.seed,
                                               num_samples, tokenizer, cache_dir=config.data.data_cache_path,
                                               **options)
    return RankData(kind, tokenizer, True, fields, datasets, data_path[0], exists)


def _read_streamed(config: Config, tokenizer: Tokenizer, num_samples: tuple, exists: tuple, fields: dict,
                   packing) -> RankData:
    """--hf-dataset: the three splits as streams tokenised by one pool of --num-workers processes."""
    data = config.data
    dataset = open_hf_dataset(data.hf_dataset, data.hf_dataset_text_key, data.data_cache_path)
    key = data.hf_dataset_text_key

    def read(indices: list) -> list:
        return dataset[indices][key]

    pool = TokenizingPool(tokenizer, data.num_workers)
    datasets = build_streamed_datasets(read, len(dataset), data.hf_dataset, data.split, config.model.seq_length,
                                       config.training.seed, num_samples, pool, packing)
    how = (f"{data.num_workers} worker process{'es' if data.num_workers > 1 else ''}" if data.num_workers
           else "the training process")
    return RankData("gpt", tokenizer, True, fields, datasets, None, exists,
                    streamed=f"Hugging Face dataset {data.hf_dataset} ({len(dataset)} documents, column '{key}'), "
                             f"tokenised by {how} as it is read")


class BatchSource:
    """Global batches for this rank: per call, the m microbatch dicts its model chunks read, on its device."""

    def __init__(self, data: RankData, ps: ParallelState, device: torch.device, micro_batch_size: int,
                 seq_length: int, num_microbatches: int):
        self.data, self.ps, self.device = data, ps, device
        self.seq_length = seq_length
        self.shape = (num_microbatches, micro_batch_size, seq_length // ps.cp_size)
        self.batch_slice = ps.batch_slice  # which equal slice of each global batch this rank reads
        roles = stage_roles(ps)
        fields = data.fields
        self.fields = sorted({key for role in roles for key in fields[role]})
        self.tensor_fields = self.fields if ps.tp_size > 1 and roles & {"first", "last"} else []
        self.middle_fields = list(fields["middle"]) if _has_middle_only_ranks(ps) else []

    def share(self, num_microbatches: int, batch_slice: tuple[int, int]) -> None:
        """Read ``num_microbatches`` per batch of slice ``batch_slice`` (index, count) from the next ``batches``
        on: fault-tolerant replicas after their number changed (``replicas/``)."""
        self.shape = (num_microbatches,) + self.shape[1:]
        self.batch_slice = batch_slice

    def batches(self, split: str, consumed_samples: int = 0) -> Iterator[list[dict]]:
        """Endless iterator of global batches of ``split`` from ``consumed_samples`` on."""
        loader = None
        if self.data.reads:
            dataset = self.data.datasets[SPLIT_NAMES.index(split)]
            loader = iter(build_pretraining_data_loader(dataset, consumed_samples, self.shape[1], *self.batch_slice))
        while True:
            yield self._next(loader)

    def _next(self, loader) -> list[dict]:
        stacked = self._read(loader) if loader is not None else {}
        self._broadcast(stacked, self.tensor_fields, self.ps.tp_group, self.ps.members["tensor"])
        self._broadcast(stacked, self.middle_fields, self.ps.mp_group, self.ps.members["model_parallel"])
        return [{key: stacked[key][i] for key in self.fields} for i in range(self.shape[0])]

    def _read(self, loader) -> dict[str, torch.Tensor]:
        """The next m microbatches of the loader, each needed key stacked to ``[m, b, ...]`` (this context rank's
        tokens only), on the device."""
        microbatches = [next(loader) for _ in range(self.shape[0])]
        if self.data.kind == "bert":
            for batch in microbatches:
                batch["tokens"] = batch.pop("text")
        stacked = {key: torch.stack([batch[key] for batch in microbatches]) for key in self.fields
                   if key not in HOST_FIELDS}
        if "sequence_documents" in self.fields:
            stacked["sequence_documents"] = stacked["document_ids"]  # before the context cut
        return {key: value if key in HOST_FIELDS else to_device(value, self.device)
                for key, value in context_share(stacked, self.seq_length, self.ps).items()}

    def _broadcast(self, stacked: dict, keys: list, group, members: list) -> None:
        """Fill ``stacked[key]`` for ``keys`` from ``members[0]`` (which holds them) over ``group``."""
        if not keys or group is None or len(members) == 1:
            return
        for key in keys:
            if self.ps.rank != members[0]:
                dtype = torch.float32 if key in FLOAT_FIELDS else torch.int64
                shape = self.shape[:2] if key in PER_SAMPLE_FIELDS else self.shape
                if key in HOST_FIELDS:
                    shape = self.shape[:2] + (self.seq_length,)
                received = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(received, members[0], group=group)
                stacked.setdefault(key, received.cpu() if key in HOST_FIELDS else received)  # one copy per batch
            else:
                sent = to_device(stacked[key], self.device) if key in HOST_FIELDS else stacked[key]
                dist.broadcast(sent, members[0], group=group)
