"""A model's per-layer profile on one device, stored as JSON: the planner's only input about the model.

For every layer (the embedding, each transformer block, the head) and every profiled
micro-batch size b it holds forward and backward seconds, the backward seconds under
activation recomputation (forward again, then backward), the bytes of the layer's output (what
a pipeline boundary after it sends) and of the tensors it keeps for backward (its stash), with
the part of the stash and of the parameters that a tensor-parallel rank holds 1/t of. The
model shape is stored so that a profile of another model is refused. Values at micro-batch
sizes between the profiled ones are interpolated linearly; outside, the end segments are
extended (so a fixed per-call overhead carries over). A profile also holds the seconds the
optimizer step takes per parameter (0 when not measured).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

import numpy as np

from megapipe.config import ModelConfig
from megapipe.config.moe import LayerFreq, moe_layer_pattern
from megapipe.errors import ConfigError
from megapipe.models.flops import expert_parameters

PROFILE_FORMAT = "megapipe-profile/1"
LAYER_KINDS = ("embedding", "block", "head")
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_PER_SIZE_FIELDS = ("forward_s", "backward_s", "recompute_backward_s", "output_bytes", "stash_bytes",
                    "split_stash_bytes")
_FIX = "re-create it with tools/profile_model.py"
_MOE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq")


@dataclass(frozen=True)
class ModelShape:
    """The shape that makes two models cost the same; a profile is only valid for its own shape."""

    kind: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int
    tied_embeddings: bool = True
    num_experts: int = 0  # routed experts per MoE block (0: dense MLPs)
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0  # each expert's (0: ffn_hidden_size)
    moe_layer_freq: LayerFreq = 1  # which blocks hold experts (--moe-layer-freq: every N-th, or a 0/1 per block)

    def __post_init__(self):
        if isinstance(self.moe_layer_freq, list):  # read back from JSON
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))

    @staticmethod
    def from_config(kind: str, config: ModelConfig) -> "ModelShape":
        moe = config.num_experts is not None
        return ModelShape(kind, config.num_layers, config.hidden_size, config.num_attention_heads, config.seq_length,
                          config.vocab_size, config.ffn_hidden_size, not config.untie_embeddings_and_output_weights,
                          config.num_experts or 0, config.moe_router_topk if moe else 0,
                          config.expert_ffn_hidden_size if moe else 0, config.moe_layer_freq if moe else 1)

    def to_config(self, **overrides) -> ModelConfig:
        """A ModelConfig of this shape (dropout and numerics from ``overrides`` or the defaults); an MoE shape's
        linear layers have no biases, as megapipe's experts require."""
        moe = dict(num_experts=self.num_experts, moe_router_topk=self.moe_router_topk,
                   moe_ffn_hidden_size=self.expert_ffn_hidden_size, moe_layer_freq=self.moe_layer_freq,
                   add_bias_linear=False) if self.is_moe else {}
        return ModelConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                           num_attention_heads=self.num_attention_heads, seq_length=self.seq_length,
                           vocab_size=self.vocab_size, ffn_hidden_size=self.ffn_hidden_size,
                           untie_embeddings_and_output_weights=not self.tied_embeddings, **{**moe, **overrides})

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` (from 0) holds experts instead of a dense MLP."""
        return self.is_moe and moe_layer_pattern(self.moe_layer_freq, self.num_layers)[layer]

    @property
    def moe_layers(self) -> list[int]:
        """The blocks (from 0) that hold experts."""
        return [layer for layer in range(self.num_layers) if self.is_moe_layer(layer)]

    def active_ffn_hidden_size(self, layer: int) -> int:
        """The MLP width one token passes through in block ``layer``: its k experts' together in an MoE block."""
        return self.moe_router_topk * self.expert_ffn_hidden_size if self.is_moe_layer(layer) else self.ffn_hidden_size

    @property
    def expert_params_per_block(self) -> int:
        """The routed experts' parameters of one MoE block (``models.flops.expert_parameters``); expert parallelism
        holds 1/e of them, tensor parallelism 1/t."""
        return expert_parameters(self.to_config()) if self.is_moe else 0

    def check_same(self, other: "ModelShape", source: str) -> None:
        """Raise when ``other`` (the model to plan) differs from this profile's model."""
        for item in fields(self):
            mine, theirs = getattr(self, item.name), getattr(other, item.name)
            if mine != theirs:
                raise ConfigError(f"{source} was measured for a model with {item.name} {mine}, but the model to plan "
                                  f"has {item.name} {theirs}; profile this model with tools/profile_model.py.")


@dataclass(frozen=True)
class LayerProfile:
    """One layer; every tuple is aligned with ``ModelProfile.micro_batch_sizes``."""

    name: str
    kind: str  # one of LAYER_KINDS
    params: int
    split_params: int  # of ``params``, those a tensor-parallel rank holds 1/t of
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    recompute_backward_s: tuple[float, ...]  # forward again plus backward; equals backward_s outside blocks
    output_bytes: tuple[float, ...]
    stash_bytes: tuple[float, ...]  # kept from forward until backward (parameters excluded)
    split_stash_bytes: tuple[float, ...]  # of ``stash_bytes``, what a tensor-parallel rank holds 1/t of


@dataclass(frozen=True)
class LayerCosts:
    """Every layer's numbers at one micro-batch size, as arrays indexed by layer."""

    forward: np.ndarray
    backward: np.ndarray
    recompute_backward: np.ndarray
    output_bytes: np.ndarray
    stash_bytes: np.ndarray
    split_stash_bytes: np.ndarray
    params: np.ndarray
    split_params: np.ndarray


def interpolate(sizes: np.ndarray, values: np.ndarray, size: float) -> np.ndarray:
    """Piecewise-linear values at ``size`` (rows of ``values`` follow ``sizes``), extended with the end segments.

    One profiled size scales proportionally. Below the smallest size a value never drops under
    its proportional share (a steep first segment would otherwise reach zero), and beyond the
    largest it never shrinks (noise can make a last segment slope down).
    """
    if len(sizes) == 1:
        return values[0] * (size / sizes[0])
    k = int(np.clip(np.searchsorted(sizes, size) - 1, 0, len(sizes) - 2))
    slope = (values[k + 1] - values[k]) / (sizes[k + 1] - sizes[k])
    if size > sizes[-1]:
        slope = np.maximum(slope, 0.0)
    value = values[k] + slope * (size - sizes[k])
    if size < sizes[0]:
        value = np.maximum(value, values[0] * (size / sizes[0]))
    return value


@dataclass(frozen=True)
class ModelProfile:
    shape: ModelShape
    micro_batch_sizes: tuple[int, ...]
    layers: tuple[LayerProfile, ...]
    dtype: str  # of weights and activations
    device: str  # what it was measured on, or "analytic"
    source: str  # "measured" or "analytic"
    optimizer_step_s_per_param: float = 0.0

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def output_weight_params(self) -> int:
        """Parameters the last stage holds when it does not hold the embedding: a copy of the tied word
        embedding (the profiled head owns none of them), or nothing when the head has its own weight."""
        if not self.shape.tied_embeddings:
            return 0
        return self.layers[0].split_params

    def block_indices(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kind == "block"]

    def costs(self, micro_batch_size: float) -> LayerCosts:
        sizes = np.asarray(self.micro_batch_sizes, dtype=float)
        table = {name: np.array([getattr(layer, name) for layer in self.layers], dtype=float).T
                 for name in _PER_SIZE_FIELDS}
        at = {name: interpolate(sizes, values, micro_batch_size) for name, values in table.items()}
        return LayerCosts(forward=at["forward_s"], backward=at["backward_s"],
                          recompute_backward=at["recompute_backward_s"], output_bytes=at["output_bytes"],
                          stash_bytes=at["stash_bytes"], split_stash_bytes=at["split_stash_bytes"],
                          params=np.array([layer.params for layer in self.layers], dtype=float),
                          split_params=np.array([layer.split_params for layer in self.layers], dtype=float))

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": PROFILE_FORMAT, "model": asdict(self.shape), "micro_batch_sizes": list(self.micro_batch_sizes),
                "dtype": self.dtype, "device": self.device, "source": self.source,
                "optimizer_step_s_per_param": self.optimizer_step_s_per_param,
                "layers": [asdict(layer) for layer in self.layers]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path, expected: Optional[ModelShape] = None) -> "ModelProfile":
        """Read and check a profile; with ``expected``, refuse a profile of another model."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"profile {path} does not exist; create it with tools/profile_model.py.") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"profile {path} is not valid JSON ({error.msg} at line {error.lineno}); {_FIX}.") from None
        profile = ModelProfile.from_dict(data, f"profile {path}")
        if expected is not None:
            profile.shape.check_same(expected, f"profile {path}")
        return profile

    @staticmethod
    def from_dict(data: dict, source: str = "the profile") -> "ModelProfile":
        def need(mapping: dict, key: str, where: str):
            if not isinstance(mapping, dict) or key not in mapping:
                raise ConfigError(f"{source} lacks the field {where}{key}; {_FIX}.")
            return mapping[key]

        if need(data, "format", "") != PROFILE_FORMAT:
            raise ConfigError(f"{source} has format {data['format']!r}, not {PROFILE_FORMAT!r}; {_FIX}.")
        model = need(data, "model", "")
        shape = ModelShape(**{f.name: need(model, f.name, "model.") for f in fields(ModelShape)
                              if f.name not in _MOE_FIELDS or f.name in model})  # dense profiles predate them
        sizes = tuple(int(b) for b in need(data, "micro_batch_sizes", ""))
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ConfigError(f"{source} has micro_batch_sizes {list(sizes)}; they must be increasing positive "
                              f"integers; {_FIX}.")
        dtype = need(data, "dtype", "")
        if dtype not in ELEMENT_BYTES:
            raise ConfigError(f"{source} has dtype {dtype!r}; use one of {', '.join(ELEMENT_BYTES)}; {_FIX}.")
        layers = []
        for index, raw in enumerate(need(data, "layers", "")):
            where = f"layers[{index}]."
            values = {f.name: need(raw, f.name, where) for f in fields(LayerProfile)}
            for name in _PER_SIZE_FIELDS:
                if len(values[name]) != len(sizes):
                    raise ConfigError(f"{source} has {len(values[name])} values in {where}{name} for "
                                      f"{len(sizes)} micro-batch sizes; {_FIX}.")
                values[name] = tuple(float(v) for v in values[name])
            if values["kind"] not in LAYER_KINDS:
                raise ConfigError(f"{source} has kind {values['kind']!r} in {where}kind; use one of "
                                  f"{', '.join(LAYER_KINDS)}; {_FIX}.")
            layers.append(LayerProfile(**values))
        kinds = [layer.kind for layer in layers]
        if kinds != ["embedding"] + ["block"] * shape.num_layers + ["head"]:
            raise ConfigError(f"{source} does not hold an embedding, {shape.num_layers} blocks and a head in this "
                              f"order; {_FIX}.")
        return ModelProfile(shape, sizes, tuple(layers), dtype, need(data, "device", ""), need(data, "source", ""),
                            float(need(data, "optimizer_step_s_per_param", "")))
