"""The cluster the service places jobs on: the backend's hosts and their devices, as of the last look.

Worker agents register and send heartbeats here (a Slurm backend finds its nodes itself); the
round loop refreshes the view (``refresh``) and turns the mechanism's worker ids into host slots.
"""

from __future__ import annotations

from megapipe.cluster.core.cluster_spec import devices_text
from megapipe.cluster.service.backends.agents import AgentsBackend
from megapipe.cluster.service.backends.base import HostSlots
from megapipe.cluster.service.names import check_name
from megapipe.errors import ConfigError


class Workers:
    def __init__(self, backend, worker_types: tuple, announce):
        """``backend``: what runs the ranks (see ``ClusterService``); ``announce``: where joins and losses are said."""
        self.backend, self.worker_types, self.announce = backend, tuple(worker_types), announce
        self.agents = backend if isinstance(backend, AgentsBackend) else None
        self.hosts: dict = {}  # host -> {worker type: devices}, as of the last refresh

    def register(self, host: str, address: str, devices: dict, throttle: dict) -> None:
        check_name("the worker's --host", host)
        check_name("the worker's --address", address)
        if self.agents is None:
            raise ConfigError(f"worker {host} registered with a scheduler that runs its jobs through Slurm; it takes "
                              "no worker agents (start serve without --backend slurm for them).")
        unknown = [t for t in devices if t not in self.worker_types]
        if unknown:
            raise ConfigError(f"worker {host} declares accelerator type {unknown[0]!r}, which this scheduler does not "
                              f"know; declare one of {', '.join(self.worker_types)} (or start serve with "
                              "--worker-types listing it).")
        if not devices or any(int(n) < 1 for n in devices.values()):
            raise ConfigError(f"worker {host} declares no devices; pass --devices TYPE:N with N at least 1.")
        if any(t not in devices or not 0 < float(f) <= 1 for t, f in throttle.items()):
            raise ConfigError(f"worker {host} declares a --throttle outside its devices or (0, 1]; write e.g. "
                              "slow:0.5 for a type of --devices.")
        self.agents.register(host, address, {t: int(n) for t, n in devices.items()},
                             {t: float(f) for t, f in throttle.items()})
        quotas = "".join(f", {t} at {float(f):g} CPU each" for t, f in sorted(throttle.items()) if float(f) < 1)
        self.announce(f"worker {host} registered: {devices_text(devices)}{quotas}")

    def heartbeat(self, host: str, running: dict):
        """The agent's messages (ranks to start or stop), or None for a host that is not registered."""
        return None if self.agents is None else self.agents.heartbeat(host, running)

    def refresh(self) -> set:
        """Forget lost agents (saying so), look at the backend's hosts; returns the job ids whose ranks run."""
        if self.agents is not None:
            for host in self.agents.forget_lost():
                self.announce(f"worker {host} lost: no heartbeat for {self.agents.lost_seconds:g} s; its "
                              "jobs go back to the queue")
        self.hosts = self.backend.nodes()
        return self.backend.running_job_ids()

    def throttles(self) -> dict:
        """Each worker type's CPU quota where agents throttle it."""
        return self.agents.throttles() if self.agents else {}

    def devices_by_type(self) -> dict:
        """The registered workers' devices summed per type, as of the last refresh: the cluster the rounds
        place jobs on, and what ``status`` and submission judge a job's placeability against."""
        counts: dict = {}
        for devices in self.hosts.values():
            for worker_type, n in devices.items():
                counts[worker_type] = counts.get(worker_type, 0) + n
        return counts

    def type_speeds(self) -> dict:
        """Relative speed of each worker type: its CPU quota where agents throttle it, else 1."""
        throttles = self.throttles()
        return {t: throttles.get(t, 1.0) for devices in self.hosts.values() for t in devices}

    def host_slots(self, servers: dict, worker_type: str, workers: tuple) -> tuple:
        """The mechanism's worker ids of a type (``servers``: the mechanism's, per type) as per-host slots
        (ids count the type's devices over hosts by name)."""
        ids = [w for server in servers[worker_type] for w in server]
        owners = [host for host in sorted(self.hosts) for _ in range(self.hosts[host].get(worker_type, 0))]
        counts: dict = {}
        for worker in workers:
            host = owners[ids.index(worker)]
            counts[host] = counts.get(host, 0) + 1
        return tuple(HostSlots(host, worker_type, n) for host, n in counts.items())
