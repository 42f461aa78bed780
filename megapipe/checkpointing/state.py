"""This rank's tensors in a checkpoint, by checkpoint key.

Keys (canonical parameter names, global shapes; see ``shards.place``)::

    model/<name>                      the weight, in the run's parameter dtype
    optimizer/<name>/master           its fp32 master copy (bf16/fp16 runs)
    optimizer/<name>/<state>          optimizer state of the same shape (exp_avg, exp_avg_sq,
                                      momentum_buffer) split like the weight, or a scalar (step)
    rng/rank_<r>/{cpu,device,tracker/<stream>}   random generator states of global rank r
    inflight/rank_<r>/...             what rank r's asynchronous pipeline held between two
                                      batches (``megapipe.pipeline.in_flight``; PipeDream, 2BW)

Saving lists this rank's pieces (``save_shards``); loading lists the blocks this rank needs,
read into fresh buffers (``LoadTargets``), so nothing touches the model until every read
has succeeded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megapipe.checkpointing.shards import Shard, place
from megapipe.config import ModelConfig
from megapipe.parallel.state import ParallelState
from megapipe.parallel.random import capture_rng, restore_rng

MASTER = "master"


def model_key(name: str) -> str:
    return f"model/{name}"


def optimizer_key(name: str, state: str) -> str:
    return f"optimizer/{name}/{state}"


def rng_prefix(rank: int) -> str:
    return f"rng/rank_{rank}/"


def in_flight_prefix(rank: int) -> str:
    return f"inflight/rank_{rank}/"


def is_rank_local(key: str) -> bool:
    """Random states and in-flight pipeline state: they belong to the ranks of the layout that wrote them."""
    return key.startswith(("rng/", "inflight/"))


def precision_optimizers(optimizer) -> list:
    """The PrecisionOptimizers behind the engine's optimizer (one, or one per chunk in an OptimizerGroup)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


@dataclass
class ParamEntry:
    """A parameter of this rank: its chunk-local name, the parameter, its fp32 main weight and
    optimizer state (whole, even when the optimizer holds only a data-parallel shard of them)
    and the PrecisionOptimizer that steps it."""

    name: str
    param: torch.nn.Parameter
    main: torch.Tensor  # the fp32 master, or the parameter itself in fp32 runs without sharding
    optimizer: object
    states: dict = field(default_factory=dict)  # optimizer state name -> tensor shaped like the parameter

    def key(self, ps: ParallelState, config: ModelConfig) -> str:
        return place(self.name, self.param, self.param, ps, config)[0]

    def shard(self, tensor: torch.Tensor, ps: ParallelState, config: ModelConfig) -> Optional[Shard]:
        """This rank's block of ``tensor`` (the weight or anything shaped like it) in the global tensor."""
        if tensor.dim() == 0:  # a scalar such as Adam's step count: the same on every rank
            return Shard.whole(tensor)
        return place(self.name, tensor, self.param, ps, config)[1]


def checkpointed_tensors(chunk):
    """(name, tensor) of what a checkpoint holds of ``chunk``: its parameters and its persistent buffers
    (the routers' expert biases, which training moves outside the gradient, so a resume needs them)."""
    yield from chunk.named_parameters()
    persistent = chunk.state_dict(keep_vars=True)
    yield from ((name, buffer) for name, buffer in chunk.named_buffers() if name in persistent)


def param_entries(chunks, optimizer=None) -> list[ParamEntry]:
    """Every parameter (and persistent buffer) of ``chunks`` once, with its main tensor, optimizer state and
    optimizer (none: weights only). A sharded optimizer gathers whole tensors over the data-parallel group
    (collective)."""
    owner = {key: (main, opt, states) for opt in (precision_optimizers(optimizer) if optimizer else [])
             for key, (main, states) in opt.param_states().items()}
    entries, seen = [], set()
    for chunk in chunks:
        for name, param in checkpointed_tensors(chunk):
            if id(param) not in seen:
                seen.add(id(param))
                main, opt, states = owner.get(id(param), (param, None, {}))
                entries.append(ParamEntry(name, param, main, opt, states))
    return entries


def save_shards(entries: list[ParamEntry], ps: ParallelState, config: ModelConfig, device: torch.device,
                with_optimizer: bool, in_flight: Optional[dict[str, torch.Tensor]] = None) -> dict[str, Shard]:
    """This rank's pieces of the weights, (optionally) the optimizer state, its random states and
    what its pipeline holds in flight (``InFlight.to_tensors()``)."""
    out = {in_flight_prefix(ps.rank) + name: Shard.whole(t) for name, t in (in_flight or {}).items()}

    def add(key: str, shard: Optional[Shard]) -> None:
        if shard is not None:
            out[key] = shard

    for entry in entries:
        key = entry.key(ps, config)
        add(model_key(key), entry.shard(entry.param.detach(), ps, config))
        if not with_optimizer:
            continue
        if entry.main is not entry.param:
            add(optimizer_key(key, MASTER), entry.shard(entry.main.detach(), ps, config))
        for state, value in entry.states.items():
            add(optimizer_key(key, state), entry.shard(value, ps, config))
    out.update(rng_shards(ps, device))
    return out


def rng_shards(ps: ParallelState, device: torch.device) -> dict[str, Shard]:
    """The default generators and the tensor-parallel tracker's streams of this rank."""
    prefix = rng_prefix(ps.rank)
    return {prefix + name: Shard.whole(state) for name, state in capture_rng(ps.rng_tracker, device).items()}


@dataclass
class LoadTargets:
    """Fresh buffers for what this rank reads, and where each goes once every read succeeded."""

    shards: dict[str, Shard] = field(default_factory=dict)  # checkpoint key -> block to fill
    weights: list[tuple[ParamEntry, torch.Tensor]] = field(default_factory=list)  # fp32 value of each param
    optimizer: list[tuple[ParamEntry, dict[str, torch.Tensor]]] = field(default_factory=list)
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    in_flight: dict[str, torch.Tensor] = field(default_factory=dict)


def load_targets(entries: list[ParamEntry], saved: dict, ps: ParallelState, config: ModelConfig,
                 with_optimizer: bool, with_rng: bool, with_in_flight: bool = False) -> LoadTargets:
    """What this rank reads; ``saved`` is the checkpoint's key -> TensorStorageMetadata."""
    targets = LoadTargets()
    buffers: dict[str, torch.Tensor] = {}

    def request(key: str, entry: ParamEntry, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if key not in buffers:
            buffers[key] = torch.zeros(like.shape, dtype=dtype, device=like.device)
            shard = entry.shard(buffers[key], ps, config)
            if shard is not None:
                targets.shards[key] = shard
        return buffers[key]

    saved_states: dict[str, dict] = {}  # parameter name -> {state name: metadata}, masters left out
    for name, md in saved.items():
        if name.startswith("optimizer/") and not name.endswith("/" + MASTER):
            param_name, state = name.removeprefix("optimizer/").rsplit("/", 1)
            saved_states.setdefault(param_name, {})[state] = md
    for entry in entries:
        key = entry.key(ps, config)
        # the fp32 master is the precise weight; checkpoints of fp32 runs have none
        source = optimizer_key(key, MASTER) if optimizer_key(key, MASTER) in saved else model_key(key)
        targets.weights.append((entry, request(source, entry, entry.param, torch.float32)))
        if with_optimizer:
            targets.optimizer.append((entry, {
                state: request(optimizer_key(key, state), entry,
                               entry.main if len(md.size) else entry.main.new_zeros(()), md.properties.dtype)
                for state, md in saved_states.get(key, {}).items()}))
    if with_rng:
        targets.rng = _rank_tensors(saved, rng_prefix(ps.rank), targets.shards)
    if with_in_flight:
        targets.in_flight = _rank_tensors(saved, in_flight_prefix(ps.rank), targets.shards)
    return targets


def _rank_tensors(saved: dict, prefix: str, shards: dict[str, Shard]) -> dict[str, torch.Tensor]:
    """Buffers for the whole tensors one rank saved under ``prefix``, by name after it (CPU)."""
    out = {}
    for key, md in saved.items():
        if key.startswith(prefix):
            out[key[len(prefix):]] = torch.zeros(md.size, dtype=md.properties.dtype)
            shards[key] = Shard.whole(out[key[len(prefix):]])
    return out


@torch.no_grad()
def apply_weights(targets: LoadTargets, optimizer=None) -> None:
    """Set the model weights, and the optimizer's fp32 main weights (or its shards of them), from the read values."""
    for entry, value in targets.weights:
        entry.param.copy_(value)
    for precision in precision_optimizers(optimizer) if optimizer is not None else ():
        precision.load_main_weights({id(entry.param): value for entry, value in targets.weights
                                     if entry.optimizer is precision})


def apply_optimizer(targets: LoadTargets, optimizer) -> None:
    """Hand the read state (whole tensors) to each optimizer, which keeps its shard, casts and places it.

    Two parameters of one rank with one checkpoint key (the tied embedding's copies when the V
    placement puts the first and last stage together) read one buffer: each gets its own copy, as
    an optimizer may keep the tensor it is given and update it in place."""
    handed: set[int] = set()

    def own(value: torch.Tensor) -> torch.Tensor:
        if id(value) in handed:
            return value.clone()
        handed.add(id(value))
        return value

    for precision in precision_optimizers(optimizer):
        precision.load_param_states({id(entry.param): {name: own(value) for name, value in values.items()}
                                     for entry, values in targets.optimizer if values and entry.optimizer is precision})


def apply_rng(rng: dict[str, torch.Tensor], ps: ParallelState, device: torch.device) -> None:
    restore_rng(rng, ps.rng_tracker, device)
