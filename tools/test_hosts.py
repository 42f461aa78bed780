"""Run a command on N hosts made of network namespaces on this machine (root; removed afterwards).

    sudo python tools/test_hosts.py --hosts 2 --rate-mbit 200 -- bash examples/train_gpt_multinode.sh

Each host runs the command once, with NNODES, NODE_RANK, MASTER_ADDR (host 0's address) and
HOST_ADDR (its own) in its environment, so a multi-node launch script runs as it would on N
machines, each host's processes reaching the others only through a (shaped) link. Their output
is prefixed with ``[host i]``. The exit status is the first non-zero one; Ctrl-C, SIGTERM, a failure or
``--timeout`` tears everything down, processes inside the hosts included.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from megapipe.errors import reports_user_errors
from megapipe.testing.hosts import TestHosts


def _relay(index: int, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"[host {index}] {line}")
        sys.stdout.flush()


@reports_user_errors
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--rate-mbit", type=float, default=None, help="bandwidth of each host's link")
    parser.add_argument("--latency-ms", type=float, default=None, help="one-way delay of each host's link (netem)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before everything is killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each host runs")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command each host runs after --")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill tears the hosts down too
    with TestHosts(args.hosts, args.rate_mbit, args.latency_ms) as hosts:
        print(f"{args.hosts} hosts: " + ", ".join(f"host {h.index} = {h.address} ({h.namespace})" for h in hosts.hosts),
              flush=True)
        procs, relays = [], []
        for host in hosts.hosts:
            env = dict(os.environ, NNODES=str(args.hosts), NODE_RANK=str(host.index), MASTER_ADDR=hosts[0].address,
                       HOST_ADDR=host.address)
            proc = hosts.popen(host.index, command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
            relays.append(threading.Thread(target=_relay, args=(host.index, proc), daemon=True))
            relays[-1].start()
            procs.append(proc)
        deadline = time.monotonic() + args.timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                print(f"error: the hosts did not finish within --timeout {args.timeout:g} s; killing them.",
                      file=sys.stderr)
                return 124
        for relay in relays:  # the last lines of output
            relay.join(timeout=5)
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
