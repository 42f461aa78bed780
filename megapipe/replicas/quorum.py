"""Which replicas train the next step: the lighthouse's rounds of arrivals (pure; the clock is passed in).

Before every step each live replica *arrives* with its iteration and the session its process drew at
start. A round closes once every member of the last quorum has arrived or is *gone*: silent (no heartbeat
or arrival) for longer than the heartbeat timeout, or not arrived within the join timeout of the round's
first arrival. Replicas outside the last quorum that arrived join it. Before the first quorum every
replica of the job is expected, for at most the join timeout. The quorum's id changes only when its
members or their sessions do (a replica relaunched between two rounds is a new member), or when a
member asks for new groups because a collective of its old ones failed; replicas make a new
cross-replica process group only then.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Quorum:
    """The replicas that train a step (``members``, ascending), each one's iteration and session on arrival."""

    id: int
    members: tuple[int, ...]
    iterations: tuple[int, ...]
    sessions: tuple[str, ...]

    @property
    def width(self) -> int:
        return len(self.members)

    @property
    def newest(self) -> int:
        """The iteration the quorum trains from: the most advanced member's."""
        return max(self.iterations)

    @property
    def source(self) -> int:
        """The index of the member the others copy the state from when they are behind (the first newest)."""
        return self.iterations.index(self.newest)

    @property
    def behind(self) -> tuple[int, ...]:
        """The members whose state is older than the quorum's: they receive it before the step."""
        return tuple(member for member, iteration in zip(self.members, self.iterations) if iteration < self.newest)

    def index(self, replica: int) -> int:
        return self.members.index(replica)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> "Quorum":
        return cls(int(value["id"]), tuple(value["members"]), tuple(value["iterations"]), tuple(value["sessions"]))


class Rounds:
    """The lighthouse's state: arrivals of the open round, last contact per replica, the last quorum."""

    def __init__(self, replicas: int, heartbeat_timeout: float, join_timeout: float):
        self.replicas, self.heartbeat_timeout, self.join_timeout = replicas, heartbeat_timeout, join_timeout
        self.last: Optional[Quorum] = None
        self.round = 0  # the open round's number
        self.arrived: dict[int, tuple[int, str, bool]] = {}  # replica -> (iteration, session, renew), this round
        self.opened: Optional[float] = None  # when the open round's first replica arrived
        self.seen: dict[int, float] = {}  # replica -> its last heartbeat or arrival
        self.decided: dict[int, Quorum] = {}  # round -> its quorum (the last few)
        self.fingerprint: Optional[str] = None  # what every replica must be started with: the first one's

    def admits(self, replica: int, fingerprint: str) -> Optional[str]:
        """Why ``replica`` cannot join (a layout, model or batch other than the first replica's), or None."""
        if self.fingerprint is None:
            self.fingerprint = fingerprint
        if fingerprint == self.fingerprint:
            return None
        return (f"replica {replica} was started with {fingerprint}, but the job's replicas run {self.fingerprint}; "
                "start every replica with the same flags but --replica-id.")

    def heartbeat(self, replica: int, now: float) -> None:
        self.seen[replica] = now

    def arrive(self, replica: int, iteration: int, session: str, now: float, renew: bool = False) -> int:
        """Note ``replica``'s arrival (``renew``: its groups failed, new ones are needed); the round whose quorum
        it waits for (``decided``)."""
        self.seen[replica] = now
        self.arrived[replica] = (iteration, session, renew)
        if self.opened is None:
            self.opened = now
        return self.round

    def silent(self, replica: int, now: float) -> bool:
        """No heartbeat or arrival from ``replica`` for longer than the heartbeat timeout."""
        seen = self.seen.get(replica)
        return seen is not None and now - seen > self.heartbeat_timeout

    def gone(self, replica: int, now: float) -> bool:
        """Whether the open round stops waiting for ``replica`` (module docstring)."""
        late = self.opened is not None and now - self.opened > self.join_timeout
        return late or self.silent(replica, now)

    def waiting_for(self, now: float) -> list[int]:
        """The replicas the open round still waits for."""
        expected = self.last.members if self.last is not None else range(self.replicas)
        return [replica for replica in expected if replica not in self.arrived and not self.gone(replica, now)]

    def decide(self, now: float) -> Optional[Quorum]:
        """Close the open round if nobody is waited for any more; its quorum, or None."""
        if self.waiting_for(now) or not any(not self.silent(r, now) for r in self.arrived):
            return None
        members = tuple(sorted(r for r in self.arrived if not self.silent(r, now)))  # died since it arrived: out
        sessions = tuple(self.arrived[m][1] for m in members)
        same = (self.last is not None and (self.last.members, self.last.sessions) == (members, sessions)
                and not any(self.arrived[m][2] for m in members))
        number = (self.last.id if same else self.last.id + 1) if self.last is not None else 0
        quorum = Quorum(number, members, tuple(self.arrived[m][0] for m in members), sessions)
        self.decided[self.round] = self.last = quorum
        self.decided.pop(self.round - 8, None)  # a caller reads its round's quorum long before 8 more close
        self.round, self.arrived, self.opened = self.round + 1, {}, None
        return quorum
