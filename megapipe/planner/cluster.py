"""The machines a plan is for: nodes of identical devices, their memory and two link speeds.

A JSON description::

    {"nodes": 8, "gpus_per_node": 8, "memory_per_gpu": 17179869184,
     "intra_node_bandwidth": 1.5e11, "inter_node_bandwidth": 3.125e9,
     "peak_flops": 1.25e14}

Bandwidths are bytes per second per device; optional keys: ``intra_node_latency`` and
``inter_node_latency`` (seconds per message or collective step), ``intra_node_reduce_bandwidth``
and ``inter_node_reduce_bandwidth`` (the bandwidth term of a ring all-reduce, when reducing
costs more than sending, as with gloo on busy CPUs; default the link's), ``intra_node_reduce_latency``
and ``inter_node_reduce_latency`` (seconds per step of a collective, when a step, which needs both
peers running, costs more than a message; default the link's latency), ``reserved_memory`` (bytes
per device the runtime takes), ``compute_speed`` (device speed relative to the device the
profile was measured on), ``shared_cores`` (the devices are processes sharing this many cores,
each worth one device at full speed, as when a CPU runs more processes than it has cores: a
batch then takes at least all devices' compute over that many), ``achieved_flops`` (what a device reaches on large GEMMs, for
closed-form profiles), ``node_uplink_bandwidth`` (a node's one link to the others, shared by
whatever leaves the node at once, each flow still at most ``inter_node_bandwidth``; unset, each
device has ``inter_node_bandwidth`` of its own),
``peak_flops``, ``backend`` (``nccl`` or ``gloo``: the collectives'
algorithms, see ``traffic.py``) and ``name``. Global rank r sits on node
``r // gpus_per_node``, the order torchrun assigns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterable, Optional

from megapipe.errors import ConfigError
from megapipe.planner.json_file import read_json

_REQUIRED = ("nodes", "gpus_per_node", "memory_per_gpu", "intra_node_bandwidth", "inter_node_bandwidth")


def _or(value: Optional[float], default: float) -> float:
    return default if value is None else value


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes per second
    latency: float  # seconds per message
    reduce_bandwidth: float  # bytes per second in a ring all-reduce's 2 (n-1)/n |bytes| term
    reduce_latency: float  # seconds per step of a collective


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    memory_per_gpu: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float = 0.0
    inter_node_latency: float = 0.0
    intra_node_reduce_bandwidth: Optional[float] = None
    inter_node_reduce_bandwidth: Optional[float] = None
    intra_node_reduce_latency: Optional[float] = None
    inter_node_reduce_latency: Optional[float] = None
    reserved_memory: float = 0.0
    compute_speed: float = 1.0
    shared_cores: Optional[float] = None
    achieved_flops: Optional[float] = None
    peak_flops: Optional[float] = None
    node_uplink_bandwidth: Optional[float] = None
    backend: str = "nccl"
    name: str = ""

    def __post_init__(self):
        source = f"cluster {self.name}" if self.name else "the cluster description"
        for key in ("nodes", "gpus_per_node"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source} has {key} {value}; it must be a whole number of at least 1.")
        for key in ("memory_per_gpu", "intra_node_bandwidth", "inter_node_bandwidth", "compute_speed"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{source} has {key} {getattr(self, key)}; it must be positive.")
        for key in ("intra_node_reduce_bandwidth", "inter_node_reduce_bandwidth", "shared_cores",
                    "node_uplink_bandwidth"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ConfigError(f"{source} has {key} {getattr(self, key)}; it must be positive.")
        for key in ("intra_node_latency", "inter_node_latency", "reserved_memory", "intra_node_reduce_latency",
                    "inter_node_reduce_latency"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise ConfigError(f"{source} has {key} {getattr(self, key)}; it must not be negative.")
        if self.backend not in ("nccl", "gloo"):
            raise ConfigError(f"{source} has backend {self.backend!r}; use 'nccl' or 'gloo'.")
        if self.reserved_memory >= self.memory_per_gpu:
            raise ConfigError(f"{source} reserves {self.reserved_memory:.0f} of {self.memory_per_gpu:.0f} bytes per "
                              "device; reserved_memory must leave room for the model.")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_memory(self) -> float:
        return self.memory_per_gpu - self.reserved_memory

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link(self, ranks: Iterable[int]) -> Link:
        """The slowest link a collective or message among ``ranks`` crosses: intra-node if they share a node."""
        if len({self.node_of(r) for r in ranks}) <= 1:
            return Link(self.intra_node_bandwidth, self.intra_node_latency,
                        self.intra_node_reduce_bandwidth or self.intra_node_bandwidth,
                        _or(self.intra_node_reduce_latency, self.intra_node_latency))
        return Link(self.inter_node_bandwidth, self.inter_node_latency,
                    self.inter_node_reduce_bandwidth or self.inter_node_bandwidth,
                    _or(self.inter_node_reduce_latency, self.inter_node_latency))

    def group_link(self, groups: list[list[int]]) -> Link:
        """The link that limits collectives (or messages) running at once in every group of ``groups``,
        each a ring in the order given: the slowest pair's link; with a shared node uplink, its
        bandwidth split between the groups whose ring leaves the busiest node at the same time, and no
        more than one device's ``inter_node_bandwidth`` per flow."""
        link = min((self.link(group) for group in groups),
                   key=lambda link: (link.bandwidth, link.reduce_bandwidth, -link.latency))
        if self.node_uplink_bandwidth is None or all(len({self.node_of(r) for r in g}) <= 1 for g in groups):
            return link
        leaving: dict[int, int] = {}
        for group in groups:
            senders = {self.node_of(group[i]) for i in range(len(group))
                       if self.node_of(group[i]) != self.node_of(group[(i + 1) % len(group)])}
            for node in senders:
                leaving[node] = leaving.get(node, 0) + 1
        bandwidth = min(link.bandwidth, self.node_uplink_bandwidth / max(leaving.values()))
        reduce = min(link.reduce_bandwidth, bandwidth) if self.inter_node_reduce_bandwidth else bandwidth
        return Link(bandwidth, link.latency, reduce, link.reduce_latency)

    def to_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}

    @staticmethod
    def from_dict(data: dict, source: str = "the cluster description") -> "Cluster":
        if not isinstance(data, dict):
            raise ConfigError(f"{source} must be a JSON object with {', '.join(_REQUIRED)}.")
        missing = [key for key in _REQUIRED if key not in data]
        if missing:
            raise ConfigError(f"{source} lacks {', '.join(missing)}; add them (bandwidths in bytes per second, memory "
                              "in bytes).")
        known = {f.name for f in fields(Cluster)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source} has unknown keys {', '.join(unknown)}; the keys are {', '.join(sorted(known))}.")
        values = dict(data)
        values.setdefault("name", Path(source).stem if source.endswith(".json") else "")
        return Cluster(**values)

    @staticmethod
    def load(path: str | Path) -> "Cluster":
        data = read_json(path, "cluster file", "pass a JSON file or a preset name",
                         "correct it or pass a preset name")
        return Cluster.from_dict(data, str(path))
