"""A model's per-layer profile on one device, stored as JSON: the planner's only input about the model.

For every layer (the embedding, each transformer block, the head) and every profiled
micro-batch size b it holds forward and backward seconds, the backward seconds under
activation recomputation (forward again, then backward), the bytes of the layer's output (what
a pipeline boundary after it sends) and of the tensors it keeps for backward (its stash), with
the part of the stash and of the parameters that a tensor-parallel rank holds 1/t of. The
model shape (``megapipe.models.shape``) is stored so that a profile of another model is refused; a
profile written before a shape field existed reads with that field's default, which describes a GPT
(GeLU, multi-head attention, LayerNorm), so an older profile of a Llama is refused and must be
re-created with tools/profile_model.py. Values at micro-batch sizes between the profiled ones are
interpolated linearly; outside, the end segments are extended (so a fixed per-call overhead carries
over). A profile also holds the seconds the optimizer step takes per parameter (0 when not measured).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Optional

import numpy as np

from megapipe.errors import ConfigError
from megapipe.models.shape import ModelShape
from megapipe.planner.json_file import read_json

PROFILE_FORMAT = "megapipe-profile/1"
LAYER_KINDS = ("embedding", "block", "head")
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_PER_SIZE_FIELDS = ("forward_s", "backward_s", "recompute_backward_s", "output_bytes", "stash_bytes",
                    "split_stash_bytes")
_FIX = "re-create it with tools/profile_model.py"


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
        data = read_json(path, "profile", "create it with tools/profile_model.py", _FIX)
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
                              if f.default is MISSING or f.name in model})  # older profiles lack the later ones
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
