"""The lighthouse: one small service per fault-tolerant job that decides each step's quorum of replicas.

Start it once, where every replica can reach it, before the replicas (``--lighthouse HOST:PORT``)::

    python -m megapipe.replicas.lighthouse --replicas 2 --port 29600

It answers ``POST /quorum`` (a replica's arrival before a step: ``{"replica", "iteration", "session",
"fingerprint"}``, the last saying what the replica was started with: every replica must match the first)
(``"renew": true`` after its groups failed) once the round closes (``quorum.py``) with the quorum and the port of the key-value store it also runs,
on which the replicas of a quorum meet to make their process groups; ``POST /heartbeat`` notes that a
replica is alive; ``GET /status`` gives the last quorum. It keeps no training state: restarted, it
forms a new quorum from the replicas that arrive.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Optional

from megapipe.errors import ConfigError, reports_user_errors
from megapipe.json_http import JsonHandler, Refusal, json_object
from megapipe.replicas.quorum import Rounds

EXAMPLE = '{"replica": 0, "iteration": 12, "session": "3f2a", "fingerprint": "(t, p, d) = (1, 1, 1), ..."}'


def _field(body: dict, name: str, kind: type, replicas: int):
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise Refusal(400, f"the field {name!r} is missing or not {'a number' if kind is int else 'a string'}; send "
                           f"an object such as {EXAMPLE}.")
    if name == "replica" and not 0 <= value < replicas:
        raise Refusal(400, f"replica {value} is not one of this job's {replicas} (0 to {replicas - 1}); start it with "
                           "--replica-id below --fault-tolerant-replicas.")
    return value


class Lighthouse:
    """The rounds behind a lock, and the blocking wait of each arrival for its round's quorum."""

    def __init__(self, replicas: int, heartbeat_timeout: float, join_timeout: float, store_port: int, clock=time.monotonic):
        self.rounds = Rounds(replicas, heartbeat_timeout, join_timeout)
        self.store_port, self.clock = store_port, clock
        self.changed = threading.Condition()

    def arrive(self, replica: int, iteration: int, session: str, renew: bool, fingerprint: str) -> dict:
        with self.changed:
            refused = self.rounds.admits(replica, fingerprint)
            if refused is not None:
                raise Refusal(409, refused)
            number = self.rounds.arrive(replica, iteration, session, self.clock(), renew)
            while number not in self.rounds.decided:
                if self.rounds.decide(self.clock()) is not None:
                    self.changed.notify_all()
                else:
                    self.changed.wait(0.1)  # a round also closes when a member goes silent: look again soon
            return {"quorum": self.rounds.decided[number].to_json(), "store_port": self.store_port}

    def heartbeat(self, replica: int) -> None:
        with self.changed:
            self.rounds.heartbeat(replica, self.clock())

    def status(self) -> dict:
        with self.changed:
            last = self.rounds.last
            return {"quorum": None if last is None else last.to_json(), "store_port": self.store_port,
                    "waiting_for": self.rounds.waiting_for(self.clock()) if self.rounds.arrived else []}


def make_handler(lighthouse: Lighthouse, replicas: int):
    class Handler(JsonHandler):
        timeout = 30.0
        max_body_bytes = 4096
        limit_text = "the lighthouse's limit of 4096 bytes"
        waited_text = "30 s"
        body_required = True
        logs_requests = False  # one arrival per replica and step

        def do_POST(self):  # noqa: N802 (http.server's name)
            try:
                body = json_object(self.read_json_body(), EXAMPLE)
                replica = _field(body, "replica", int, replicas)
                if self.path == "/heartbeat":
                    lighthouse.heartbeat(replica)
                    return self.send_json(200, {})
                if self.path != "/quorum":
                    raise Refusal(404, f"no endpoint {self.path[:60]!r}; use POST /quorum or POST /heartbeat.")
                answer = lighthouse.arrive(replica, _field(body, "iteration", int, replicas),
                                           _field(body, "session", str, replicas), body.get("renew") is True,
                                           _field(body, "fingerprint", str, replicas))
            except Refusal as refusal:
                return self.send_refusal(refusal)
            return self.send_json(200, answer)

        def do_GET(self):  # noqa: N802
            if self.path != "/status":
                return self.send_json(404, {"error": f"no endpoint {self.path[:60]!r}; use GET /status."})
            return self.send_json(200, lighthouse.status())

        def refuse_method(self) -> None:
            self.send_json(405, {"error": f"{self.command[:40]} is not served here; send POST /quorum, POST "
                                          "/heartbeat or GET /status."}, (("Allow", "GET, POST"),))

        do_PUT = do_DELETE = do_PATCH = refuse_method  # noqa: N815 (http.server's names)

        def malformed(self, code: int, message) -> str:
            return f"the request is malformed ({message or code}); send POST /quorum with a JSON body."

    return Handler


def serve(replicas: int, host: str, port: int, heartbeat_timeout: float = 5.0, join_timeout: float = 30.0,
          store_port: Optional[int] = None, announce=print) -> ThreadingHTTPServer:
    """Start the store and the HTTP service (in threads); the server, whose ``shutdown`` stops the service."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port + 1 if store_port is None else store_port, is_master=True, wait_for_workers=False,  # 0: any
                     timeout=datetime.timedelta(seconds=60))
    lighthouse = Lighthouse(replicas, heartbeat_timeout, join_timeout, store.port)
    server = ThreadingHTTPServer((host, port), make_handler(lighthouse, replicas))
    server.daemon_threads = True
    server.store = store  # lives as long as the server
    threading.Thread(target=server.serve_forever, name="lighthouse", daemon=True).start()
    announce(f"lighthouse for {replicas} replicas on http://{host}:{server.server_address[1]} "
             f"(store on port {store.port})", flush=True)
    return server


@reports_user_errors
def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megapipe.replicas.lighthouse", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, required=True, help="the job's --fault-tolerant-replicas")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default every interface)")
    parser.add_argument("--port", type=int, default=29600, help="HTTP port; the store listens on the next one")
    parser.add_argument("--heartbeat-timeout-seconds", type=float, default=5.0,
                        help="a replica silent this long is dropped from the next quorum (default 5)")
    parser.add_argument("--join-timeout-seconds", type=float, default=30.0,
                        help="a round waits at most this long for a member of the last quorum (default 30)")
    args = parser.parse_args(argv)
    if args.replicas < 1:
        raise ConfigError(f"--replicas {args.replicas} must be at least 1: the job's --fault-tolerant-replicas.")
    if args.heartbeat_timeout_seconds <= 0 or args.join_timeout_seconds <= 0:
        raise ConfigError("--heartbeat-timeout-seconds and --join-timeout-seconds must be above 0.")
    server = serve(args.replicas, args.host, args.port, args.heartbeat_timeout_seconds, args.join_timeout_seconds)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    sys.exit(main())
