"""Named clusters and GPT shapes for planning without writing JSON.

Clusters follow the seeds' setups. ``v100-16gb`` is the 2BW evaluation's eight AWS p3.16xlarge
servers (8 V100 16 GB with NVLink, 25 Gbit/s between servers; seed 002 section 3.4); each
device gets an eighth of the server's network, since all eight talk across servers at once.
Its achieved rate is the seed's 45 TFLOP/s for a 355M GPT on one V100. ``a100-80gb`` is
Selene-like (8 A100 80 GB per node on NVSwitch, one 200 Gbit/s HCA per GPU; section 4.5)
reaching the seed's 140 TFLOP/s per GPU. Effective NVLink bandwidths are our estimates.
``h100-80gb`` and ``h200-141gb`` are DGX H100 / DGX H200 nodes: 8 SXM GPUs on NVLink 4 through
NVSwitch (900 GB/s per GPU, both directions together, NVIDIA H100 and H200 datasheets; we count
300 GB/s effective per direction, the same 2/3 of the one-way figure as the A100 preset), and one
400 Gbit/s NDR InfiniBand ConnectX-7 adapter per GPU (DGX H100/H200 user guides), 50 GB/s per
device between nodes. Dense BF16 peak 989 TFLOP/s for both (the datasheets' 1,979 is with
sparsity); memory 80 GB HBM3 and 141 GB HBM3e. Achieved 400 TFLOP/s per GPU is our estimate
(about 40% of peak, the model FLOP utilisation large Megatron-LM GPT runs report on H100); the
H200's faster memory (4.8 vs 3.35 TB/s) is not modelled.
GPT shapes are Megatron-like; layer counts and widths were chosen so that eq. 4.3 gives the
named sizes at s = 512 and V = 51,200 (the seeds do not list them).
"""

from __future__ import annotations

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.planner.cluster import Cluster
from megapipe.planner.profile import ModelShape
from megapipe.planner.units import GIB


def _v100(nodes: int) -> Cluster:
    return Cluster(nodes=nodes, gpus_per_node=8, memory_per_gpu=16 * GIB, reserved_memory=1 * GIB,
                   intra_node_bandwidth=100e9, inter_node_bandwidth=25e9 / 8 / 8, intra_node_latency=10e-6,
                   inter_node_latency=30e-6, achieved_flops=45e12, peak_flops=125e12, name=f"{nodes}x8 V100 16GB")


def _a100(nodes: int) -> Cluster:
    return Cluster(nodes=nodes, gpus_per_node=8, memory_per_gpu=80 * GIB, reserved_memory=2 * GIB,
                   intra_node_bandwidth=200e9, inter_node_bandwidth=200e9 / 8, intra_node_latency=10e-6,
                   inter_node_latency=20e-6, achieved_flops=140e12, peak_flops=312e12, name=f"{nodes}x8 A100 80GB")


def _hopper(nodes: int, memory_gib: int, name: str) -> Cluster:
    return Cluster(nodes=nodes, gpus_per_node=8, memory_per_gpu=memory_gib * GIB, reserved_memory=2 * GIB,
                   intra_node_bandwidth=300e9, inter_node_bandwidth=400e9 / 8, intra_node_latency=10e-6,
                   inter_node_latency=20e-6, achieved_flops=400e12, peak_flops=989e12,
                   name=f"{nodes}x8 {name} {memory_gib}GB")


CLUSTERS = {
    "v100-16gb-1x8": _v100(1),
    "v100-16gb-8x8": _v100(8),
    "a100-80gb-1x8": _a100(1),
    "a100-80gb-8x8": _a100(8),
    "h100-80gb-1x8": _hopper(1, 80, "H100"),
    "h100-80gb-8x8": _hopper(8, 80, "H100"),
    "h200-141gb-1x8": _hopper(1, 141, "H200"),
    "h200-141gb-8x8": _hopper(8, 141, "H200"),
}


def _gpt(num_layers: int, hidden_size: int, heads: int, seq_length: int = 512) -> ModelShape:
    return ModelShape.from_config("gpt", ModelConfig(num_layers=num_layers, hidden_size=hidden_size,
                                                     num_attention_heads=heads, seq_length=seq_length,
                                                     vocab_size=51200))


MODELS = {
    "gpt-355m": _gpt(24, 1024, 16),
    "gpt-1.3b": _gpt(24, 2048, 16),
    "gpt-2.2b": _gpt(32, 2304, 24),
    "gpt-3.8b": _gpt(32, 3072, 32),
}


def parameter_count(shape: ModelShape) -> float:
    """Seed 002 eq. 4.3: P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))."""
    l, h = shape.num_layers, shape.hidden_size
    return 12 * l * h * h * (1 + 13 / (12 * h) + (shape.vocab_size + shape.seq_length) / (12 * l * h))


def cluster_preset(name: str) -> Cluster:
    if name not in CLUSTERS:
        raise ConfigError(f"cluster preset {name!r} is unknown; use one of {', '.join(CLUSTERS)} or a JSON file.")
    return CLUSTERS[name]


def model_preset(name: str) -> ModelShape:
    if name not in MODELS:
        raise ConfigError(f"model preset {name!r} is unknown; use one of {', '.join(MODELS)} or pass --profile.")
    return MODELS[name]
