"""Shared pieces of the fake-device tests: small model configurations, pipeline ranks with stand-in
groups, and a stubbed transport that completes every message at once and records it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist

from megapipe.config import ModelConfig
from megapipe.models.families import family
from megapipe.parallel.state import ParallelState
from megapipe.layout.ranks import RankLayout

S, H, V = 16, 32, 100
# how PyTorch words a fake tensor meeting a tensor on another device (a RuntimeError; torch 2.11 says
# "found two different devices meta, cpu", later versions "found at least two devices, meta and cpu")
DEVICE_MISMATCH = r"found (at least )?two (different )?devices"


def model_config(kind: str, precision: str = "fp32", **options) -> ModelConfig:
    """A two-layer GPT or BERT of hidden size ``H`` and vocabulary ``V`` (``options`` override fields)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    options = dict(dict(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=S, vocab_size=V), **options)
    return family(kind).model_config(params_dtype=dtype, **options)


class _Done:
    """The handle of a stubbed send, receive or collective: already complete."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def pipeline_rank(rank: int, pipeline: int, virtual: int = 1) -> ParallelState:
    """Pipeline rank ``rank`` of a t = d = 1 layout, with stand-in groups (the transport is stubbed)."""
    members = {"tensor": [rank], "data": [rank], "pipeline": list(range(pipeline)),
               "model_parallel": list(range(pipeline)), "embedding": [0, pipeline - 1]}
    groups = {name: None if len(ranks) == 1 else _Group(len(ranks)) for name, ranks in members.items()}
    return ParallelState(RankLayout(1, pipeline, 1), rank, virtual, groups, members)


@dataclass(frozen=True)
class Message:
    """One send or receive of ``dist.isend``/``dist.irecv``, as the stubbed transport saw it."""

    kind: str  # "send" or "recv"
    peer: int
    shape: tuple
    dtype: torch.dtype
    device: torch.device


@contextlib.contextmanager
def stubbed_transport(backend: str = "nccl"):
    """Pipeline messages and collectives of a process with no process group, on ``backend``: sends,
    receives and collectives complete at once (receives keep their fresh buffers) and broadcasts leave
    their objects as they are (a world of one). Yields the list of point-to-point messages posted."""
    messages: list[Message] = []

    def post(kind):
        def stub(tensor, peer, group=None, tag=0):
            messages.append(Message(kind, peer, tuple(tensor.shape), tensor.dtype, tensor.device))
            return _Done()
        return stub

    with mock.patch.object(dist, "get_backend", lambda group=None: backend), \
            mock.patch.object(dist, "P2POp", lambda *args, **kwargs: None), \
            mock.patch.object(dist, "batch_isend_irecv", lambda ops: [_Done() for _ in ops]), \
            mock.patch.object(dist, "all_reduce", lambda *args, **kwargs: _Done()), \
            mock.patch.object(dist, "isend", post("send")), mock.patch.object(dist, "irecv", post("recv")), \
            mock.patch.object(dist, "broadcast_object_list", lambda objects, src=0, group=None, device=None: None):
        yield messages
