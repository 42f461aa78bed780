"""Measure a ModelProfile with a short run on one device, using stock PyTorch module hooks.

The whole model runs as one pipeline stage. Forward and backward pre/post hooks on the
embedding and on every block timestamp each layer (after a device synchronisation on CUDA);
the head's times are what is left of the stage's forward (after the last block) and of the
backward (before the last block's). A saved-tensors hook attributes every tensor kept for
backward to the layer running when it was saved, counting each storage once and skipping
parameters; tensors saved inside attention or the MLP (except the input a column-parallel
linear keeps) and the head's vocabulary-wide logits are the part tensor parallelism splits.
A second pass runs each block under ``torch.utils.checkpoint`` to time recomputation. Passes
and micro-batch sizes take turns, so load from other programs on the machine hits them alike;
each time is the median over the timed rounds. Last, the optimizer step (megapipe's Adam) is
timed per parameter.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megapipe.config import ModelConfig
from megapipe.parallel.launch import synchronize
from megapipe.models import build_model_chunks
from megapipe.models.transformer import MLP, SelfAttention
from megapipe.optim import GradBuffers, OptimizerConfig, build_optimizer
from megapipe.parallel.state import ParallelState
from megapipe.planner.profile import ELEMENT_BYTES, LayerProfile, ModelProfile, ModelShape
from megapipe.tensor_parallel.layers import ColumnParallelLinear
from megapipe.tensor_parallel.utils import is_tensor_parallel

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class _Checkpointed(nn.Module):
    """A block whose backward first repeats its forward (full activation recomputation)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, hidden, *layer_inputs):
        return checkpoint(self.block, hidden, *layer_inputs, use_reentrant=False)


def synthetic_batch(kind: str, config: ModelConfig, micro_batch_size: int, device: torch.device,
                    seed: int = 0) -> dict:
    """Random tokens and labels with the keys the GPT or BERT stage reads."""
    g = torch.Generator().manual_seed(seed)
    shape = (micro_batch_size, config.seq_length)
    batch = {"tokens": torch.randint(0, config.vocab_size, shape, generator=g),
             "labels": torch.randint(0, config.vocab_size, shape, generator=g),
             "loss_mask": torch.ones(shape)}
    if kind == "bert":
        batch.update(types=torch.randint(0, 2, shape, generator=g), padding_mask=torch.ones(shape, dtype=torch.long),
                     is_random=torch.randint(0, 2, (micro_batch_size,), generator=g))
    return {key: value.to(device) for key, value in batch.items()}


class _Recorder:
    """Hooks on one stage that record a single forward/backward iteration."""

    def __init__(self, stage: nn.Module, blocks: list[nn.Module], device: torch.device, vocab_slice: int):
        self.stage, self.blocks, self.device, self.vocab_slice = stage, blocks, device, vocab_slice
        self.times: dict = {}
        self.outputs: dict = {}
        self.owner: Optional[object] = None  # "embedding", a block index or "head"
        self.module_stack: list[nn.Module] = []
        self.stash: dict = defaultdict(float)
        self.split_stash: dict = defaultdict(float)
        self.seen_storages: set[int] = set()
        self.param_storages = {p.untyped_storage().data_ptr() for p in stage.parameters()}
        self.handles = []
        self._hook_layer("embedding", stage.embedding)
        for index, block in enumerate(blocks):
            self._hook_layer(index, block)
            self.handles.append(block.register_full_backward_pre_hook(self._stamp_hook(("bwd_start", index))))
            self.handles.append(block.register_full_backward_hook(self._stamp_hook(("bwd_end", index))))
        self.handles.append(stage.register_forward_hook(self._stamp_hook("fwd_end")))
        for module in stage.modules():
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, module, _args) -> None:
        self.module_stack.append(module)

    def _leave(self, _module, _args, _output) -> None:
        self.module_stack.pop()

    def now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def _stamp_hook(self, key):
        def hook(*_):
            self.times[key] = self.now()
        return hook

    def _hook_layer(self, owner, module: nn.Module) -> None:
        def before(_module, _args):
            self.owner = owner
            self.times[("fwd_start", owner)] = self.now()

        def after(_module, _args, output):
            self.times[("fwd_end", owner)] = self.now()
            self.outputs[owner] = output.numel() * output.element_size()
            self.owner = "head" if owner == len(self.blocks) - 1 else None

        self.handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def _is_split(self, tensor: torch.Tensor) -> bool:
        if self.owner == "head":
            return tensor.dim() > 0 and tensor.shape[-1] == self.vocab_slice
        innermost = self.module_stack[-1] if self.module_stack else None
        in_region = any(isinstance(m, (SelfAttention, MLP)) for m in self.module_stack)
        return in_region and not isinstance(innermost, ColumnParallelLinear)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if self.owner is not None and key not in self.param_storages and key not in self.seen_storages:
            self.seen_storages.add(key)
            self.stash[self.owner] += storage.nbytes()
            if self._is_split(tensor):
                self.split_stash[self.owner] += storage.nbytes()
        return tensor

    def run(self, batch: dict) -> None:
        for record in (self.times, self.stash, self.split_stash, self.seen_storages):
            record.clear()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            loss = self.stage(None, batch)
        self.times["bwd_begin"] = self.now()
        loss.backward()
        self.times["bwd_finish"] = self.now()
        self.stage.zero_grad(set_to_none=True)

    def layer_times(self) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of [embedding, blocks..., head] for the last run."""
        t, n = self.times, len(self.blocks)
        forward = [t[("fwd_end", "embedding")] - t[("fwd_start", "embedding")]]
        forward += [t[("fwd_end", i)] - t[("fwd_start", i)] for i in range(n)]
        forward.append(t["fwd_end"] - t[("fwd_end", n - 1)])
        backward = [t["bwd_finish"] - t[("bwd_end", 0)]]
        backward += [t[("bwd_end", i)] - t[("bwd_start", i)] for i in range(n)]
        backward.append(t[("bwd_start", n - 1)] - t["bwd_begin"])
        return forward, backward

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Passes:
    """Runs one timed iteration of the plain or the checkpointed model, swapping the block wrappers in."""

    def __init__(self, stage: nn.Module, device: torch.device, vocab_slice: int):
        self.stage, self.device, self.vocab_slice = stage, device, vocab_slice
        self.names = list(stage.layers.keys())
        self.blocks = [stage.layers[name] for name in self.names]
        self.wrapped = [_Checkpointed(block) for block in self.blocks]

    def run(self, batch: dict, checkpointed: bool) -> _Recorder:
        layers = self.wrapped if checkpointed else self.blocks
        for name, layer in zip(self.names, layers):
            self.stage.layers[name] = layer
        recorder = _Recorder(self.stage, layers, self.device, self.vocab_slice)
        recorder.run(batch)
        recorder.remove()
        for name, block in zip(self.names, self.blocks):
            self.stage.layers[name] = block
        return recorder


def _medians(samples: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float]]:
    """Per-layer medians of forward and backward times over the timed iterations."""
    forward = [statistics.median(run[0][k] for run in samples) for k in range(len(samples[0][0]))]
    backward = [statistics.median(run[1][k] for run in samples) for k in range(len(samples[0][1]))]
    return forward, backward


def _optimizer_seconds_per_param(stage: nn.Module, batch: dict, device: torch.device, repeats: int) -> float:
    """The median of ``repeats`` Adam steps over the whole stage (after one that creates the state), per parameter."""
    grads = GradBuffers([stage], stage.ps)
    optimizer = build_optimizer([stage], OptimizerConfig(optimizer="adam", lr=1e-6), stage.ps, grads)
    stage(None, batch).backward()
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        optimizer.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    optimizer.zero_grad()
    return statistics.median(times[1:]) / sum(p.numel() for p in stage.parameters())


def _layer_params(stage: nn.Module, blocks: list[nn.Module]) -> list[tuple[int, int]]:
    """(params, split params) of [embedding, blocks..., head]; the head owns what no other layer does."""
    def count(params) -> tuple[int, int]:
        params = list(params)
        return sum(p.numel() for p in params), sum(p.numel() for p in params if is_tensor_parallel(p))

    owned = {id(p) for module in [stage.embedding, *blocks] for p in module.parameters()}
    head = [p for p in stage.parameters() if id(p) not in owned]
    return [count(stage.embedding.parameters())] + [count(b.parameters()) for b in blocks] + [count(head)]


def profile_model(kind: str, config: ModelConfig, micro_batch_sizes: Sequence[int] = (1, 2, 4),
                  iterations: int = 5, warmup: int = 2, device: Optional[torch.device] = None,
                  seed: int = 1234) -> ModelProfile:
    """Profile a GPT or BERT of ``config`` on ``device`` (default: the CPU)."""
    device = device or torch.device("cpu")
    ps = ParallelState.single()
    stage = build_model_chunks(kind, config, ps, seed=seed, device=device)[0]
    stage.train()
    passes = _Passes(stage, device, config.padded_vocab_size(1))
    batches = {b: synthetic_batch(kind, config, b, device, seed=b) for b in micro_batch_sizes}
    times = {(b, mode): [] for b in micro_batch_sizes for mode in (False, True)}
    recorders = {}
    for iteration in range(warmup + iterations):  # round robin, so load from other programs hits every size alike
        for b in micro_batch_sizes:
            for checkpointed in (False, True):
                recorder = passes.run(batches[b], checkpointed)
                if iteration >= warmup:
                    times[(b, checkpointed)].append(recorder.layer_times())
                if not checkpointed:
                    recorders[b] = recorder
    owners = ["embedding", *range(len(passes.blocks)), "head"]
    per_size = []
    for b in micro_batch_sizes:
        forward, backward = _medians(times[(b, False)])
        _, recompute = _medians(times[(b, True)])
        recorder = recorders[b]
        outputs = [recorder.outputs[o] for o in owners[:-1]] + [ELEMENT_BYTES["float32"]]  # the head emits the loss
        per_size.append(dict(forward_s=forward, backward_s=backward,
                             recompute_backward_s=[backward[0], *recompute[1:-1], backward[-1]],  # only blocks
                             output_bytes=outputs, stash_bytes=[recorder.stash[o] for o in owners],
                             split_stash_bytes=[recorder.split_stash[o] for o in owners]))
    names, blocks = passes.names, passes.blocks
    layer_names = ["embedding", *(f"block.{name}" for name in names), "head"]
    kinds = ["embedding"] + ["block"] * len(blocks) + ["head"]
    layers = []
    for index, ((params, split), name, layer_kind) in enumerate(zip(_layer_params(stage, blocks), layer_names, kinds)):
        series = {key: tuple(size[key][index] for size in per_size) for key in per_size[0]}
        layers.append(LayerProfile(name=name, kind=layer_kind, params=params, split_params=split, **series))
    optimizer = _optimizer_seconds_per_param(stage, batches[micro_batch_sizes[-1]], device, iterations)
    return ModelProfile(ModelShape.from_config(kind, config), tuple(micro_batch_sizes), tuple(layers),
                        _DTYPE_NAMES[config.params_dtype], str(device), "measured", optimizer)
