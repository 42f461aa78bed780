"""The embedded backend: worker agents (one per host) that poll the scheduler for work.

The scheduler side keeps, per host, the launches and stops its agent has not fetched yet and
the exit codes the agent reported. Agents reach the scheduler (never the other way round), so
a host behind NAT or in a network namespace only needs a route to the scheduler's port. An
agent that misses heartbeats for ``lost_seconds`` is lost: its jobs' ranks there count as ended
(exit code ``LOST``) and the job's ranks on other hosts are stopped.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from megapipe.cluster.service.backends.base import Launch

LOST = -1000  # exit code of ranks whose host's agent stopped answering
# torchrun's rendezvous port on a job's first host: drawn below Linux's ephemeral ports (32768 and up),
# where no outgoing connection holds one; a restarted scheduler cannot know which ports its predecessor used
RENDEZVOUS_PORTS = (10000, 32768)


@dataclass
class Agent:
    host: str
    address: str  # where this host's ranks can be reached (a job's rendezvous runs on its first host)
    devices: dict  # worker type -> count
    throttle: dict  # worker type -> CPU fraction per device, as the agent declared it
    last_seen: float = field(default_factory=time.monotonic)
    outbox: list = field(default_factory=list)  # messages not fetched yet
    exit_codes: dict = field(default_factory=dict)  # job id -> exit code of its ranks on this host
    running: set = field(default_factory=set)  # job ids whose ranks run here (as last reported)


class AgentsBackend:
    """``Backend`` over polling agents; thread-safe (HTTP handlers and the round loop call it)."""

    def __init__(self, lost_seconds: float = 5.0):
        self.lost_seconds = lost_seconds
        self.agents: dict[str, Agent] = {}
        self.hosts_of: dict[int, tuple[str, ...]] = {}  # job id -> hosts of its current launch
        self.lock = threading.Lock()
        self.random = random.Random()

    # ---- Backend ------------------------------------------------------------------------------
    def start(self, launch: Launch) -> None:
        with self.lock:
            hosts = tuple(slot.host for slot in launch.hosts)
            self.hosts_of[launch.job_id] = hosts
            master = self.agents[hosts[0]].address
            port = self.random.randrange(*RENDEZVOUS_PORTS)
            for rank, slot in enumerate(launch.hosts):
                agent = self.agents[slot.host]
                agent.exit_codes.pop(launch.job_id, None)
                agent.running.add(launch.job_id)
                agent.outbox.append({"launch": {**asdict(launch), "node_rank": rank, "master_addr": master,
                                                "master_port": port}})

    def poll(self, job_id: int) -> Optional[int]:
        """None while a rank runs on some host; else the first nonzero exit code (0 when all ended well)."""
        with self.lock:
            codes = [self.agents[h].exit_codes.get(job_id) if h in self.agents else LOST
                     for h in self.hosts_of.get(job_id, ())]
        if any(code is None for code in codes):
            return None
        return next((code for code in codes if code != 0), 0)

    def stop(self, job_id: int, grace_seconds: float) -> None:
        with self.lock:
            for host in self.hosts_of.get(job_id, ()):
                if host in self.agents and self.agents[host].exit_codes.get(job_id) is None:
                    self.agents[host].outbox.append({"stop": {"job_id": job_id, "grace_seconds": grace_seconds}})

    # ---- what agents call ---------------------------------------------------------------------
    def register(self, host: str, address: str, devices: dict, throttle: dict) -> None:
        with self.lock:
            previous = self.agents.get(host)
            agent = self.agents[host] = Agent(host, address, dict(devices), dict(throttle))
            if previous is not None:  # a restarted agent: the ranks it was given are no longer its own
                agent.exit_codes = dict(previous.exit_codes)  # those it reported, not yet polled
                for job_id, hosts in self.hosts_of.items():  # also those it had no heartbeat left to report
                    if host in hosts and job_id not in agent.exit_codes:
                        agent.exit_codes[job_id] = LOST

    def heartbeat(self, host: str, running: dict) -> Optional[list]:
        """``running``: job id -> exit code or None, for the ranks the agent started. Returns its messages."""
        with self.lock:
            agent = self.agents.get(host)
            if agent is None:
                return None
            agent.last_seen = time.monotonic()
            for job_id, code in running.items():
                if code is None:
                    agent.running.add(int(job_id))
                else:
                    agent.running.discard(int(job_id))
                    agent.exit_codes[int(job_id)] = code
            messages, agent.outbox = agent.outbox, []
            return messages

    def forget_lost(self) -> list[str]:
        """Drop agents silent for ``lost_seconds``; their jobs' ranks count as ended. Returns their hosts."""
        with self.lock:
            now = time.monotonic()
            lost = [a for a in self.agents.values() if now - a.last_seen > self.lost_seconds]
            for agent in lost:
                del self.agents[agent.host]
        return [agent.host for agent in lost]

    # ---- the inventory the service reads (as from SlurmBackend) -------------------------------------
    def nodes(self) -> dict[str, dict[str, int]]:
        """Live hosts and their devices by type, e.g. {"host-a": {"fast": 2, "slow": 2}}."""
        with self.lock:
            return {host: dict(agent.devices) for host, agent in self.agents.items()}

    def running_job_ids(self) -> set[int]:
        """Jobs some agent reports ranks of alive (of any launch, also one a previous scheduler made)."""
        with self.lock:
            return set().union(*(agent.running for agent in self.agents.values()))

    def throttles(self) -> dict[str, float]:
        """Per worker type, the smallest CPU fraction an agent declared for it (1.0: unthrottled)."""
        with self.lock:
            fractions: dict = {}
            for agent in self.agents.values():
                for worker_type in agent.devices:
                    fractions[worker_type] = min(fractions.get(worker_type, 1.0),
                                                 agent.throttle.get(worker_type, 1.0))
            return fractions
