"""The cluster: how many accelerators of each type, on servers of how many each."""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.errors import ConfigError


@dataclass(frozen=True)
class ClusterSpec:
    counts: dict  # worker type -> number of accelerators
    gpus_per_server: int = 1

    @property
    def worker_types(self) -> list[str]:
        return sorted(self.counts)

    @property
    def order(self) -> list[str]:
        """Types in the order the user listed them (the mechanism fills them in this order)."""
        return list(self.counts)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def parse_cluster(text: str, gpus_per_server: int = 1) -> ClusterSpec:
    """``v100:8,p100:16,k80:24`` -> ClusterSpec; every count a non-negative integer."""
    counts = {}
    for part in text.split(","):
        name, _, number = part.strip().partition(":")
        try:
            count = int(number)
        except ValueError:
            raise ConfigError(f"--cluster entry {part!r} is not TYPE:COUNT; write e.g. v100:8,p100:16,k80:24.")
        if count < 0:
            raise ConfigError(f"--cluster entry {part!r} has a negative count; use 0 or more accelerators.")
        if name in counts:
            raise ConfigError(f"--cluster names {name} twice; give each accelerator type once.")
        counts[name] = count
    if gpus_per_server < 1:
        raise ConfigError(f"--gpus-per-server {gpus_per_server} must be at least 1.")
    return ClusterSpec({k: v for k, v in counts.items() if v > 0}, gpus_per_server)


def devices_text(devices: dict) -> str:
    """Accelerators by type as people read them: ``{"fast": 2, "slow": 1}`` -> ``"2 fast, 1 slow"``."""
    return ", ".join(f"{n} {worker_type}" for worker_type, n in sorted(devices.items()))
