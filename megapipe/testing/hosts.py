"""Several "hosts" on one Linux machine: network namespaces joined by veth pairs to a bridge.

Each host is a network namespace with one interface (``eth0`` inside, a veth whose other end
is a port of a private bridge in the root namespace) and its own address on a private /24;
the root namespace holds the bridge's address (``TestHosts.gateway``), so a process outside
every host can still serve them (a rendezvous store, say). Ranks of one host talk through that
host's loopback, ranks of different hosts through the bridge, so what crosses "the network" is
exactly what the interface counters of the veth ports count. Inter-host links can be shaped
(bandwidth with ``tbf``, latency with ``netem`` where the kernel has it), cut and healed::

    with TestHosts(2, rate_mbit=200) as hosts:            # needs root; skip on NamespacesUnavailable
        worker = hosts.popen(1, ["python", "worker.py"])  # a process inside host 1
        hosts.run(0, ["ip", "addr"])                      # a command inside host 0, waited for
        before = hosts.counters(1)                        # bytes and packets host 1 sent and received
        hosts.cut(1); hosts.heal(1)                       # its link down, then up again
    # every process started in a host is killed, the namespaces, veths and bridge removed

Frames are capped at one MTU (``gso_max_segs 1`` on each interface), so the counters see
what a real NIC puts on the wire: one Ethernet + IP + TCP header per segment of at most
``MSS`` payload bytes, and shaping applies per frame as it would. Names are unique per
process and instance (``mp<pid>-<n>...``, within Linux's 15-character interface names), so
parallel test runs do not collide; leftovers of a process that was killed before its
teardown are removed by the next instance created on the machine.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from megapipe.errors import UserError
from megapipe.planner.traffic import FRAME_OVERHEAD, MSS, MTU  # noqa: F401 (the wire's facts, re-exported)

INTERFACE = "eth0"  # every host's interface has this name inside its namespace
_LOCK = "/run/megapipe-test-hosts.lock"
_NAME = re.compile(r"^mp([0-9a-z]+)-[0-9a-z]+")
_SUBNETS = [ipaddress.ip_network(f"10.{a}.{b}.0/24") for a in range(200, 250) for b in range(256)]


class NamespacesUnavailable(UserError, RuntimeError):
    """This machine or user cannot create network namespaces (the message says why): skip, don't fail."""


class ShapingUnavailable(UserError, RuntimeError):
    """The kernel lacks the queueing discipline a shaping request needs (the message names it)."""


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str  # for ``ip netns exec``
    address: str  # of its eth0, on the hosts' /24
    port: str  # its veth's other end, a bridge port in the root namespace


@dataclass(frozen=True)
class Counters:
    """What a host sent and received through its interface since it was created (Ethernet frames)."""

    sent_bytes: int
    received_bytes: int
    sent_packets: int
    received_packets: int

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(self.sent_bytes - other.sent_bytes, self.received_bytes - other.received_bytes,
                        self.sent_packets - other.sent_packets, self.received_packets - other.received_packets)


NETNS_EXEC = ("ip", "netns", "exec")


def inside_host(command: Sequence[str]) -> tuple[Optional[str], list[str]]:
    """(the network namespace a ``TestHosts.command`` runs ``command`` in, or None; the command without its prefix)."""
    if tuple(command[:3]) == NETNS_EXEC:
        return command[3], list(command[4:])
    return None, list(command)


def namespaces_unavailable() -> Optional[str]:
    """Why test hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if not any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(":") + ["/usr/sbin", "/sbin"]):
            return f"the {tool!r} command is missing (Debian package iproute2)"
    probe = f"mp{_base36(os.getpid())}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def enter(namespace: str) -> None:
    """Move the calling thread into the network namespace ``namespace`` (threads it starts later follow).

    For a process started by ``multiprocessing`` that should live inside a host; unlike
    ``ip netns exec`` it keeps the root namespace's view of ``/sys``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {namespace}: {os.strerror(error)}")
    finally:
        os.close(fd)


def own_counters(interface: str = INTERFACE) -> Counters:
    """The counters of ``interface`` in the calling process's own network namespace (from inside a host)."""
    with open("/proc/self/net/dev") as table:
        lines = table.readlines()
    for line in lines:
        name, _, fields = line.partition(":")
        if name.strip() == interface:
            values = [int(v) for v in fields.split()]
            return Counters(values[8], values[0], values[9], values[1])
    raise RuntimeError(f"no interface {interface} in this network namespace")


class TestHosts:
    """``count`` hosts on a private bridge; a context manager that always tears everything down."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, count: int, rate_mbit: Optional[float] = None, latency_ms: Optional[float] = None):
        reason = namespaces_unavailable()
        if reason:
            raise NamespacesUnavailable(reason)
        self.hosts: list[Host] = []
        self._started: list[subprocess.Popen] = []
        self.bridge = ""
        try:
            self._create(count)
            if rate_mbit is not None or latency_ms is not None:
                for host in range(count):
                    self.shape(host, rate_mbit, latency_ms)
        except BaseException:
            self.close()
            raise

    # ---- making and removing -------------------------------------------------------------
    def _create(self, count: int) -> None:
        os.makedirs(os.path.dirname(_LOCK), exist_ok=True)
        with open(_LOCK, "w") as lock:  # choosing names and a free subnet, and taking them, is one step
            fcntl.flock(lock, fcntl.LOCK_EX)
            _remove_orphans()
            prefix = _free_prefix()
            subnet = _free_subnet()
            addresses = list(subnet.hosts())
            self.bridge = f"{prefix}b"
            self.gateway = str(addresses[-1])
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "addrgenmode", "none")  # no IPv6 chatter in the counters
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for index in range(count):
            host = Host(index, f"{prefix}h{index}", str(addresses[index]), f"{prefix}p{index}")
            self.hosts.append(host)
            _ip("netns", "add", host.namespace)
            _ip("link", "add", host.port, "type", "veth", "peer", "name", INTERFACE, "netns", host.namespace)
            _ip("link", "set", host.port, "gso_max_segs", "1", "addrgenmode", "none", "master", self.bridge, "up")
            _ip("-n", host.namespace, "link", "set", INTERFACE, "gso_max_segs", "1", "addrgenmode", "none", "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
            _ip("-n", host.namespace, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill every process still running in a host, then remove the namespaces, veths and bridge."""
        for proc in self._started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for host in self.hosts:
            _kill_namespace_processes(host.namespace)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            subprocess.run(["ip", "link", "del", host.port], capture_output=True)  # gone with the namespace already
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.hosts, self._started, self.bridge = [], [], ""

    def __enter__(self) -> "TestHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- using ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside host ``host`` (for a launcher of one's own; ``inside_host`` undoes it)."""
        return [*NETNS_EXEC, self.hosts[host].namespace, *argv]

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` in a session of its own; killed (its group) on close."""
        proc = subprocess.Popen(self.command(host, argv), start_new_session=True, **kwargs)
        self._started.append(proc)
        return proc

    def run(self, host: int, argv: Sequence[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``host`` and wait for it (text output captured unless told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(host, argv), timeout=timeout, **kwargs)

    def counters(self, host: int) -> Counters:
        """Bytes and frames host ``host`` sent and received, read at its bridge port (whose rx is the host's tx)."""
        port = self.hosts[host].port

        def read(name):
            with open(f"/sys/class/net/{port}/statistics/{name}") as f:
                return int(f.read())
        return Counters(read("rx_bytes"), read("tx_bytes"), read("rx_packets"), read("tx_packets"))

    def kill(self, host: int) -> list[int]:
        """SIGKILL every process inside host ``host`` (the host "disappears"); the pids killed."""
        return _kill_namespace_processes(self.hosts[host].namespace)

    def cut(self, host: int) -> None:
        """Take host ``host``'s link down: nothing reaches it or leaves it until ``heal``."""
        _ip("link", "set", self.hosts[host].port, "down")

    def heal(self, host: int) -> None:
        _ip("link", "set", self.hosts[host].port, "up")

    def shape(self, host: int, rate_mbit: Optional[float], latency_ms: Optional[float] = None) -> None:
        """Limit host ``host``'s link to ``rate_mbit`` Mbit/s and add ``latency_ms`` of one-way delay, each
        direction (so a message between two hosts crosses two shaped ports: the rate holds, the delay
        doubles); None for either leaves it unshaped. Replaces any earlier shaping of the link."""
        host_ = self.hosts[host]
        for prefix, device in ((["-n", host_.namespace], INTERFACE), ([], host_.port)):
            subprocess.run(["tc", *prefix, "qdisc", "del", "dev", device, "root"], capture_output=True)
            if latency_ms is not None:
                spec = ["netem", "delay", f"{latency_ms}ms"] + (["rate", f"{rate_mbit}mbit"] if rate_mbit else [])
            elif rate_mbit is not None:
                # a burst of a few frames and a queue of 100 ms at the rate: enough for TCP, no long stalls
                burst = max(4 * MTU, int(rate_mbit * 1e6 / 8 / 250))
                limit = max(burst + MTU, int(rate_mbit * 1e6 / 8 * 0.1))
                spec = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]
            else:
                continue
            made = subprocess.run(["tc", *prefix, "qdisc", "add", "dev", device, "root", *spec],
                                  capture_output=True, text=True)
            if made.returncode != 0:
                if "unknown" in made.stderr:
                    raise ShapingUnavailable(f"this kernel has no '{spec[0]}' queueing discipline "
                                             f"({'latency needs sch_netem' if spec[0] == 'netem' else 'rate needs sch_tbf'}).")
                raise RuntimeError(f"tc qdisc add {' '.join(spec)} on {device} failed: {made.stderr.strip()}")


# ---- helpers ---------------------------------------------------------------------------------
def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        number, digit = divmod(number, 36)
        text = digits[digit] + text
        if number == 0:
            return text


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _interfaces() -> list[str]:
    return os.listdir("/sys/class/net")


def _free_prefix() -> str:
    """``mp<pid>-<n>``: the first n whose bridge does not exist yet."""
    pid, taken = _base36(os.getpid()), set(_interfaces())
    n = 0
    while f"mp{pid}-{_base36(n)}b" in taken:
        n += 1
    return f"mp{pid}-{_base36(n)}"


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200-249.x.0 that no interface of the root namespace uses, starting at a pid-dependent one."""
    shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    used = [ipaddress.ip_interface(word).network for word in re.findall(r"inet (\S+)", shown)]
    start = os.getpid() % len(_SUBNETS)
    for subnet in _SUBNETS[start:] + _SUBNETS[:start]:
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise RuntimeError("no free /24 in 10.200.0.0-10.249.255.0 for test hosts")


def _alive(pid36: str) -> bool:
    try:
        os.kill(int(pid36, 36), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_orphans() -> None:
    """Namespaces and bridges left by a process that died before its teardown."""
    for namespace in _namespaces():
        match = _NAME.match(namespace)
        if match and not _alive(match.group(1)):
            _kill_namespace_processes(namespace)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    for interface in _interfaces():
        match = _NAME.match(interface)
        if match and not _alive(match.group(1)):
            subprocess.run(["ip", "link", "del", interface], capture_output=True)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _kill_namespace_processes(namespace: str) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
    pids = [int(word) for word in listed.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        if not any(_running(pid) for pid in pids):
            break
        time.sleep(0.05)
    return pids
