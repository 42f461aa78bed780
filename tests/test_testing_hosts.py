"""The test hosts themselves: addresses, counters that count every frame, cut and heal, and a
teardown that leaves nothing behind (also for processes still running inside a host)."""

import os
import subprocess
import sys

import pytest

from megapipe.testing.hosts import FRAME_OVERHEAD, MSS, own_counters

LARGEST_CONTROL_FRAME = 14 + 20 + 20 + 40  # Ethernet, IPv4 and TCP headers, the most TCP options

RECEIVER = """
import socket, sys
server = socket.socket(); server.bind(("0.0.0.0", 5000)); server.listen()
print("listening", flush=True)
while True:
    connection, _ = server.accept()
    total = 0
    while True:
        data = connection.recv(1 << 16)
        if not data:
            break
        total += len(data)
    connection.sendall(str(total).encode()); connection.close()
"""

SENDER = """
import socket, sys
connection = socket.create_connection((sys.argv[1], 5000), timeout=float(sys.argv[3]))
connection.sendall(b"x" * int(sys.argv[2])); connection.shutdown(socket.SHUT_WR)
print(connection.recv(64).decode())
"""


def _send(hosts, source: int, target: int, nbytes: int, timeout: float = 10) -> subprocess.CompletedProcess:
    return hosts.run(source, [sys.executable, "-c", SENDER, hosts[target].address, str(nbytes), str(timeout)],
                     timeout=60)


def _retransmitted_segments(hosts, index: int) -> int:
    """TCP segments the host has retransmitted so far (its network namespace's own counter)."""
    header, values = [line.split() for line in hosts.run(index, ["cat", "/proc/net/snmp"]).stdout.splitlines()
                      if line.startswith("Tcp:")]
    return int(values[header.index("RetransSegs")])


@pytest.mark.system
def test_hosts_reach_each_other_count_every_frame_and_survive_a_cut(make_test_hosts):
    hosts = make_test_hosts(2)
    assert len({h.address for h in hosts.hosts}) == 2 and all(len(h.port) <= 15 for h in hosts.hosts)
    receiver = hosts.popen(1, [sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline().strip() == "listening"
    before, retransmitted_before = [hosts.counters(i) for i in range(2)], _retransmitted_segments(hosts, 0)
    nbytes = 3_000_000
    sent = _send(hosts, 0, 1, nbytes)
    assert sent.stdout.strip() == str(nbytes), sent.stderr
    out, into = hosts.counters(0) - before[0], hosts.counters(1) - before[1]
    retransmitted = _retransmitted_segments(hosts, 0) - retransmitted_before  # a loaded bridge may drop a frame
    # what host 0 sent is what host 1 received (one bridge between them), frame for frame, but for
    # the closing frames that may cross between the two readings: an ACK, FIN or RST carries no data,
    # only headers and TCP options (up to 40 bytes: timestamps, SACK blocks)
    assert abs(out.sent_packets - into.received_packets) <= 2
    assert abs(out.sent_bytes - into.received_bytes) <= 2 * LARGEST_CONTROL_FRAME
    # frames of at most one MTU: the payload plus one header per segment (each retransmitted one a
    # full segment again); the handshake, the close and the 7-byte reply add a few frames whose TCP
    # options differ by tens of bytes
    segments = -(-nbytes // MSS) + retransmitted
    assert segments <= out.sent_packets <= segments + 8
    assert abs(out.sent_bytes - FRAME_OVERHEAD * out.sent_packets - nbytes - retransmitted * MSS) < 200

    hosts.cut(1)
    failed = _send(hosts, 0, 1, 1000, timeout=2)
    assert failed.returncode != 0 and ("timed out" in failed.stderr or "unreachable" in failed.stderr), failed.stderr
    hosts.heal(1)
    assert _send(hosts, 0, 1, 1000).stdout.strip() == "1000"


@pytest.mark.system
def test_teardown_kills_what_runs_inside_and_removes_everything(make_test_hosts):
    hosts = make_test_hosts(3)
    namespaces, ports, bridge = [h.namespace for h in hosts.hosts], [h.port for h in hosts.hosts], hosts.bridge
    sleeper = hosts.run(2, ["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"]).stdout.strip()  # a daemon of its own
    counted = hosts.run(2, [sys.executable, "-c", "from megapipe.testing.hosts import own_counters; "
                            "print(own_counters().sent_packets >= 0)"], env=dict(os.environ)).stdout.strip()
    assert counted == "True"
    hosts.close()
    assert not os.path.exists(f"/proc/{sleeper}") or open(f"/proc/{sleeper}/stat").read().split()[2] == "Z"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in namespaces)
    assert not any(os.path.exists(f"/sys/class/net/{name}") for name in ports + [bridge])


@pytest.mark.unit
def test_own_counters_name_a_missing_interface():
    with pytest.raises(RuntimeError, match="no interface nothere0"):
        own_counters("nothere0")
