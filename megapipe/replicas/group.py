"""One rank's side of fault-tolerant replicas: the quorum, the gradient average across replicas, healing.

Each replica is a job of its own (its own ``torchrun``, world and process groups: t x c x p x e x d
ranks, every sharding level inside it). Rank r of a replica averages the gradients it steps with rank r
of every other replica of the quorum over a process group made for that quorum on the lighthouse's
store, so a lost replica breaks only those groups, never a replica's own. Before each step rank 0 asks
the lighthouse for the quorum (``agree``) and tells its replica's ranks; a new quorum means new groups,
and a member behind the others (a replica that joined) first receives the training state of the most
advanced one (``heal``): the pieces and JSON part of a checkpoint (``save.training_state``), loaded as a
checkpoint is. Whatever fails on the way (a group, the average, a transfer) fails on every rank of the
replica together (``_vote``) as ``ReplicaLost``, and the trainer discards the step.

Across replicas the state is replicated, not sharded: a shard held by one replica only would die with
it. Sharding (ZeRO-1/2/3) runs over a replica's own data-parallel ranks, as torchft's HSDP does.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megapipe.errors import UserError
from megapipe.replicas.quorum import Quorum

HEARTBEAT_SECONDS = 1.0


class ReplicaLost(RuntimeError):
    """A collective with the other replicas failed: a replica was lost during the step (discard it)."""


class LighthouseError(UserError, RuntimeError):
    """The lighthouse could not be reached or refused an arrival."""


def _post(address: str, path: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(f"http://{address}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        try:
            sentence = json.loads(error.read())["error"]
        except (ValueError, KeyError):
            sentence = f"HTTP {error.code}"
        raise LighthouseError(f"the lighthouse at {address} refused replica {body.get('replica')}: {sentence}") from None
    except (OSError, ValueError) as error:
        raise LighthouseError(f"the lighthouse at {address} did not answer ({error}); start it before the replicas "
                              "(python -m megapipe.replicas.lighthouse --replicas N --port PORT) or correct "
                              "--lighthouse HOST:PORT.") from None


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent): where the other replicas reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def _process_group(store, index: int, size: int, device: torch.device, timeout: datetime.timedelta, address: str):
    """A process group of ``size`` members on ``store`` (NCCL for GPU tensors, gloo otherwise). Gloo listens on
    ``address`` (or GLOO_SOCKET_IFNAME's interface): by default it would take the address the host name resolves
    to, which may be one the other replicas cannot reach."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, index, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface.split(",")[0]) if interface else
                        dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, index, size, options)


class ReplicaGroup:
    """This rank's view of the quorum and its process group with the same rank of the other replicas."""

    def __init__(self, lighthouse: str, replica: int, rank: int, world_size: int, device: torch.device,
                 timeout: float, fingerprint: str):
        self.lighthouse, self.replica, self.rank, self.device = lighthouse, replica, rank, device
        self.fingerprint = fingerprint  # what this replica runs (layout, model, batch): the lighthouse compares
        self.timeout = timeout
        self.session = uuid.uuid4().hex[:12]  # this process's incarnation: a relaunched replica is a new member
        # the replica's own ranks, for the quorum and the votes (gloo: small host values)
        self.control = dist.new_group(backend="gloo") if world_size > 1 else None
        self.quorum: Optional[Quorum] = None
        self.group = None  # with the same rank of the other members; None alone
        self.renew = False  # a collective of the groups failed: the next quorum must make new ones
        self._store = None
        self._stop = threading.Event()
        if rank == 0:
            threading.Thread(target=self._heartbeats, name="megapipe-replica-heartbeat", daemon=True).start()

    def _heartbeats(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                _post(self.lighthouse, "/heartbeat", {"replica": self.replica}, HEARTBEAT_SECONDS * 5)
            except LighthouseError:
                pass  # the next arrival names the problem

    def close(self) -> None:
        self._stop.set()
        self.group = None

    def agree(self, iteration: int) -> Quorum:
        """The quorum of the next step (collective over the replica); its process group made when it is new."""
        answer: list = [None]
        if self.rank == 0:
            try:
                answer[0] = _post(self.lighthouse, "/quorum", {"replica": self.replica, "iteration": iteration,
                                                               "session": self.session, "renew": self.renew,
                                                               "fingerprint": self.fingerprint},
                                  self.timeout * 2)
            except LighthouseError as error:
                answer[0] = {"error": str(error)}
        if self.control is not None:
            dist.broadcast_object_list(answer, src=0, group=self.control)
        if "error" in answer[0]:
            raise LighthouseError(answer[0]["error"])
        quorum = Quorum.from_json(answer[0]["quorum"])
        if self.quorum is None or quorum.id != self.quorum.id:
            self.quorum, self.group, self.renew = quorum, None, False
            self._connect(quorum, answer[0]["store_port"])
        self.quorum = quorum
        return quorum

    def _connect(self, quorum: Quorum, store_port: int) -> None:
        if quorum.width == 1:
            return
        error = None
        try:
            host = self.lighthouse.rsplit(":", 1)[0]
            if self._store is None:
                self._store = dist.TCPStore(host, store_port, is_master=False,
                                            timeout=datetime.timedelta(seconds=self.timeout))
            key = f"quorum/{quorum.id}/{'-'.join(quorum.sessions)}/rank/{self.rank}"
            self.group = _process_group(dist.PrefixStore(key, self._store), quorum.index(self.replica), quorum.width,
                                        self.device, datetime.timedelta(seconds=self.timeout),
                                        local_address(host, store_port))
        except RuntimeError as failure:  # a member died after the quorum formed: none of its groups forms
            error = failure
        self._vote(error, f"meeting replicas {list(quorum.members)}")

    def _vote(self, error: Optional[BaseException], what: str) -> None:
        """Raise ``ReplicaLost`` on every rank of the replica when ``what`` failed on any of them."""
        failed = torch.tensor([0 if error is None else 1])
        if self.control is not None:
            dist.all_reduce(failed, group=self.control)
        if int(failed.item()):
            self.group, self.renew = None, True  # the next quorum has a new id: every member makes new groups
            cause = f": {str(error).splitlines()[0][:200]}" if error is not None else " on another rank of this replica"
            raise ReplicaLost(f"{what} failed{cause}")

    def reduce(self, grads, riders: Sequence[torch.Tensor] = ()) -> None:
        """Average ``grads`` (a ``GradBuffers``, reduced inside the replica) over the quorum and sum each of
        ``riders`` (the step's losses) in place, under one vote: the engine's hook between the data-parallel
        reduction and the optimizer step. ``ReplicaLost`` when a replica was lost."""
        if self.group is None:
            return
        error = None
        try:
            works = [sync.reduce_across_replicas(self.group, self.quorum.width) for sync in grads.syncs]
            for work in works + [self.group.allreduce([rider]) for rider in riders]:
                work.wait()
        except RuntimeError as failure:
            error = failure
        self._vote(error, "the gradient average across replicas")

    def sum_(self, tensor: torch.Tensor) -> bool:
        """Sum ``tensor`` over this rank's counterparts (the evaluation losses); False, leaving it as it was, when
        a replica was lost since the step."""
        if self.group is None:
            return True
        kept = tensor.clone()
        try:
            self.group.allreduce([tensor]).wait()
            return True
        except RuntimeError:
            tensor.copy_(kept)
            return False

    def heal(self, encode_state: Callable[[], bytes], load_state: Callable[[bytes], None]) -> Optional[float]:
        """Send the most advanced member's state to the members behind it (the quorum's ``behind``): the source
        encodes, every member takes part, those behind load. The seconds it took, or None with nobody behind."""
        quorum = self.quorum
        if quorum is None or not quorum.behind:
            return None
        started, error, payload = time.perf_counter(), None, None
        source, receiving = quorum.source, self.replica in quorum.behind
        try:
            digest = torch.zeros(32, dtype=torch.uint8)
            if quorum.index(self.replica) == source:
                data = encode_state()
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                digest = torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)
            size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
            self.group.broadcast(size, source).wait()
            if payload is None:
                payload = torch.empty(int(size.item()), dtype=torch.uint8)
            self.group.broadcast(payload, source).wait()
            self.group.broadcast(digest, source).wait()
            data = payload.numpy().tobytes()
            if receiving and hashlib.sha256(data).digest() != digest.numpy().tobytes():
                error = ValueError("it arrived damaged (its SHA-256 differs from the sender's)")
        except RuntimeError as failure:
            error = failure
        self._vote(error, f"sending replica {quorum.members[source]}'s state to replica(s) {list(quorum.behind)}")
        if receiving:
            load_state(data)
        return time.perf_counter() - started
