"""On CUDA, the two compute streams an overlapped pair's passes run on, one each.

Autograd runs each backward op on the stream its forward op ran on, so a stream of its own for the
pair's backward changes nothing: the backward runs where its microbatch's forward ran, which is
where the pair's forward runs too if every forward shares one stream, and the GPU then runs the two
passes one after the other however the host interleaves them. So the pair's forward runs on
whichever of the two streams (the thread's main stream and one side stream) its partner backward's
microbatch did not use, and every later pass of that stage and microbatch (its B or BI, its BW)
runs on the stream its forward took. A pair starts after the main stream's work so far, and the
main stream waits for the pair before going on; a pass alone on the side stream does the same.

The caching allocator reuses a freed block as soon as the stream it was allocated on is past its
last use there, so a tensor one stream made and the other reads is marked for the reader
(``record_stream``): a side pass's inputs (the received activation or gradient, the batch) for the
side stream when it starts, its outputs (activation, loss, input gradient) for the main stream when
it ends. Weights and gradient buffers live for the whole run and are ordered by the waits above.

On the CPU there are no streams and every method does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterable, Iterator, Optional

import torch

Key = tuple[int, int]  # (stage, microbatch)


class PassStreams:
    """The streams each (stage, microbatch)'s passes run on. ``main``/``side``/``use`` default to the device's
    current stream, a new stream and ``torch.cuda.stream`` on CUDA; given, they let the choice be tested anywhere."""

    def __init__(self, device: torch.device, main=None, side=None,
                 use: Callable[[object], ContextManager] = None):
        self.enabled = device.type == "cuda" or main is not None
        if device.type == "cuda" and main is None:
            main, side, use = torch.cuda.current_stream(device), torch.cuda.Stream(device), torch.cuda.stream
        self.main, self.side, self._use = main, side, use
        self._on_side: set[Key] = set()

    def stream_of(self, key: Key):
        return self.side if key in self._on_side else self.main

    @contextlib.contextmanager
    def pair(self, forward: Key, backward: Key) -> Iterator[tuple[Callable[[], ContextManager],
                                                                 Callable[[], ContextManager]]]:
        """Around an overlapped pair: yields (forward's, backward's) stream contexts, one for each pass's thread;
        the backward keeps its microbatch's stream and the forward takes the other."""
        if not self.enabled:
            yield contextlib.nullcontext, contextlib.nullcontext
            return
        backward_stream = self.stream_of(backward)
        forward_stream = self.main if backward_stream is self.side else self.side
        if forward_stream is self.side:
            self._on_side.add(forward)
        self.side.wait_stream(self.main)
        try:
            yield (lambda: self._use(forward_stream)), (lambda: self._use(backward_stream))
        finally:
            self.main.wait_stream(self.side)

    @contextlib.contextmanager
    def alone(self, key: Optional[Key]) -> Iterator[None]:
        """Around a pass outside a pair: on its microbatch's stream (nothing to do on the main stream)."""
        if not self.enabled or key not in self._on_side:
            yield
            return
        self.side.wait_stream(self.main)
        try:
            with self._use(self.side):
                yield
        finally:
            self.main.wait_stream(self.side)

    def consumed(self, key: Key, tensors: Iterable) -> None:
        """A side pass's inputs, made on the main stream: kept from reuse until the side stream has read them."""
        self._record(key, tensors, self.side)

    def produced(self, key: Key, tensors: Iterable) -> None:
        """A side pass's outputs, read later on the main stream."""
        self._record(key, tensors, self.main)

    def _record(self, key: Key, tensors: Iterable, reader) -> None:
        if not self.enabled or key not in self._on_side:
            return
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                tensor.record_stream(reader)

    def finished(self, key: Key) -> None:
        """The last pass of ``key`` ran (its B, or its BW after a BI)."""
        self._on_side.discard(key)
