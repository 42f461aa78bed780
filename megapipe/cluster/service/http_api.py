"""The service's transport: HTTP with JSON bodies, on the standard library.

Why HTTP+JSON and not gRPC (the original system's choice): every party here is Python in the
same repository, the messages are a handful of small dictionaries a few times a second, and
HTTP needs no generated code, no extra dependency, and no daemon beyond ``http.server``; the
same port serves the status page to a browser and ``curl`` can talk to it for debugging.
Agents and jobs always call the scheduler (never the reverse), so only the scheduler listens.

Routes::

    GET  /                         the status page (HTML)
    GET  /status                   the status as JSON
    POST /jobs                     {"name", "priority", "command"}      -> {"id"}
    POST /jobs/<id>/cancel                                              -> {"ok"}
    POST /workers                  {"host", "address", "devices", "throttle"} -> {"ok"}
    POST /workers/<host>/heartbeat {"running": {job id: exit code or null}} -> {"messages"}
    POST /leases/<job>/<lease>     {"iteration", "seconds_per_iteration", "renew", "exiting"}
                                   -> {"expires_in"} | {"stop"} | {"error"}

A refused request answers 400 (404 for what does not exist) with ``{"error": sentence}``.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megapipe.cluster.service.service import ClusterService
from megapipe.cluster.service.status_page import render_status_page
from megapipe.errors import ConfigError


def serve(service: ClusterService, host: str, port: int) -> ThreadingHTTPServer:
    """Start answering on ``host:port`` in a background thread; returns the server (``.server_address``)."""
    server = ThreadingHTTPServer((host, port), _handler_for(service))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


def _handler_for(service: ClusterService):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # one line per request would drown the service's own messages
            pass

        def do_GET(self):
            if self.path == "/":
                self._send(200, render_status_page(service.status()).encode(), "text/html; charset=utf-8")
            elif self.path == "/status":
                self._json(200, service.status())
            else:
                self._json(404, {"error": f"{self.path} is not a page of this scheduler; open / or /status."})

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                self._json(*self._route(body))
            except ConfigError as error:
                self._json(400, {"error": str(error)})
            except (ValueError, KeyError, TypeError) as error:
                self._json(400, {"error": f"malformed request to {self.path} ({error}); use tools/cluster.py."})

        def _route(self, body: dict) -> tuple[int, dict]:
            path = self.path
            if path == "/jobs":
                return 200, {"id": service.submit(str(body["name"]), float(body.get("priority", 1.0)),
                                                  list(body["command"]))}
            if match := re.fullmatch(r"/jobs/(\d+)/cancel", path):
                service.cancel(int(match[1]))
                return 200, {"ok": True}
            if path == "/workers":
                service.register_worker(str(body["host"]), str(body["address"]), dict(body["devices"]),
                                        dict(body.get("throttle", {})))
                return 200, {"ok": True}
            if match := re.fullmatch(r"/workers/([^/]+)/heartbeat", path):
                messages = service.heartbeat(match[1], dict(body.get("running", {})))
                if messages is None:
                    return 404, {"error": f"worker {match[1]} is not registered; register again."}
                return 200, {"messages": messages}
            if match := re.fullmatch(r"/leases/(\d+)/(\d+)", path):
                answer = service.lease_report(int(match[1]), int(match[2]), body)
                return (404 if "error" in answer else 200), answer
            return 404, {"error": f"{path} is not a route of this scheduler; use tools/cluster.py."}

        def _json(self, code: int, value: dict) -> None:
            self._send(code, json.dumps(value).encode(), "application/json")

        def _send(self, code: int, data: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
