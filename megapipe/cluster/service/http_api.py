"""The service's transport: HTTP with JSON bodies, on the standard library, every request signed.

Why HTTP+JSON and not gRPC (the original system's choice): every party here is Python in the
same repository, the messages are a handful of small dictionaries a few times a second, and
HTTP needs no generated code, no extra dependency, and no daemon beyond ``http.server``; the
same port serves the status page to a browser and ``curl`` can talk to it for debugging.
Agents and jobs always call the scheduler (never the reverse), so only the scheduler listens.

Routes::

    GET  /                         the status page (HTML)
    GET  /status                   the status as JSON
    POST /jobs                     {"name", "priority", "command", "strict"} -> {"id", "unplaceable"}
    POST /jobs/<id>/cancel                                              -> {"ok"}
    POST /workers                  {"host", "address", "devices", "throttle"} -> {"ok"}
    POST /workers/<host>/heartbeat {"running": {job id: exit code or null}} -> {"messages"}
    POST /leases/<job>/<lease>     {"iteration", "seconds_per_iteration", "renew", "exiting", "stragglers"}
                                   -> {"expires_in"} | {"stop"} | {"error"}

Every request is signed with the cluster's secret (``megapipe/lease/auth.py``; a lease's
route also with the key derived for that lease, the two GET routes also with the status page's
``?token=``); one that is not gets 401. A refused request answers 4xx with ``{"error":
sentence}``: 400 for a malformed body or field, 404 for what does not exist, 405 for another
method, 409 for a ``strict`` job no registered worker type can hold now, 411 for a chunked body,
413 for a body over ``MAX_BODY_BYTES``, 429 when too many signed requests arrive to remember
their nonces. A refused request changes nothing. A job accepted although no worker type can hold
it now is answered with why in ``unplaceable`` (null when one can): what ``status`` shows as its
``waiting``.
"""

from __future__ import annotations

import re
import sys
import threading
import traceback
from http.server import ThreadingHTTPServer
from urllib.parse import urlsplit

from megapipe.lease.auth import ReplayGuard
from megapipe.cluster.service.placeable import Unplaceable
from megapipe.cluster.service.service import ClusterService
from megapipe.cluster.service.status_page import render_status_page
from megapipe.errors import ConfigError
from megapipe.json_http import JsonHandler, Refusal, json_object

MAX_BODY_BYTES = 1 << 20
READ_SECONDS = 10.0  # a client that stops sending mid-request is dropped after this long
NUMBER = (int, float)
EXAMPLE = '{"name": "gpt-small", "command": ["pretrain_gpt.py"]}'  # a body a refusal shows


def serve(service: ClusterService, host: str, port: int, secret: bytes) -> ThreadingHTTPServer:
    """Start answering on ``host:port`` in a background thread; returns the server (``.server_address``)."""
    server = ThreadingHTTPServer((host, port), _handler_for(service, ReplayGuard(secret)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server


def field(body: dict, route: str, key: str, kinds: tuple, what: str, default=None):
    """``body[key]`` if it is one of ``kinds`` (``default`` when absent and not None); else ConfigError."""
    if key not in body and default is not None:
        return default
    value = body.get(key)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"POST {route} needs {key!r} as {what}; use tools/cluster.py.")
    return value


def _string_map(value: dict, route: str, key: str, kinds: tuple, what: str) -> dict:
    if not all(isinstance(k, str) and isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
               for k, v in value.items()):
        raise ConfigError(f"POST {route} needs {key!r} as {what}; use tools/cluster.py.")
    return value


def _handler_for(service: ClusterService, guard: ReplayGuard):
    class Handler(JsonHandler):
        timeout = READ_SECONDS
        max_body_bytes = MAX_BODY_BYTES
        limit_text = f"the scheduler's limit of {MAX_BODY_BYTES} bytes"
        waited_text = f"{READ_SECONDS:g} s"
        logs_requests = False  # one line per request would drown the service's own messages

        def do_GET(self):
            self._answer()

        def do_POST(self):
            self._answer()

        def refuse_method(self) -> None:
            self.send_json(405, {"error": f"{self.command} is not a method of this scheduler; use GET or POST."})

        def malformed(self, code: int, message) -> str:
            return f"{message or 'the request is malformed'}; send HTTP/1.1 as tools/cluster.py does."

        def _answer(self) -> None:
            try:
                body = self.read_json_body()
                refusal = guard.refusal(self.command, self.path, self.headers, body)
                if refusal is not None:
                    raise Refusal(*refusal)
                route = urlsplit(self.path).path
                code, value = self._get(route) if self.command == "GET" else self._post(route, json_object(body, EXAMPLE) if body.strip() else {})
            except Refusal as refusal:
                return self.send_refusal(refusal)
            except Unplaceable as error:
                code, value = 409, {"error": str(error)}
            except ConfigError as error:
                code, value = 400, {"error": str(error)}
            except Exception:  # a fault of the service, not of the request: said once, in its log
                traceback.print_exc(file=sys.stderr)
                code, value = 500, {"error": f"the scheduler failed on {self.command} {self.path}; see its log."}
            if code == 200 and self.command == "GET" and urlsplit(self.path).path == "/":
                self.send_bytes(200, value["page"].encode(), "text/html; charset=utf-8")
            else:
                self.send_json(code, value)

        def _get(self, route: str) -> tuple[int, dict]:
            if route == "/":
                return 200, {"page": render_status_page(service.status())}
            if route == "/status":
                return 200, service.status()
            return 404, {"error": f"{route} is not a page of this scheduler; open / or /status."}

        def _post(self, route: str, body: dict) -> tuple[int, dict]:
            if route == "/jobs":
                name = field(body, route, "name", (str,), "a string")
                command = field(body, route, "command", (list,), "a list of strings")
                if not all(isinstance(word, str) for word in command):
                    raise ConfigError(f"POST {route} needs 'command' as a list of strings; use tools/cluster.py.")
                priority = field(body, route, "priority", NUMBER, "a number", default=1.0)
                strict = field(body, route, "strict", (bool,), "true or false", default=False)
                job_id = service.submit(name, float(priority), command, strict=strict)
                return 200, {"id": job_id, "unplaceable": service.job_unplaceable(job_id)}
            if match := re.fullmatch(r"/jobs/(\d+)/cancel", route):
                service.cancel(int(match[1]))
                return 200, {"ok": True}
            if route == "/workers":
                host = field(body, route, "host", (str,), "a string")
                address = field(body, route, "address", (str,), "a string")
                devices = _string_map(field(body, route, "devices", (dict,), "an object"), route, "devices",
                                      (int,), "an object of device counts")
                throttle = _string_map(field(body, route, "throttle", (dict,), "an object", default={}), route,
                                       "throttle", NUMBER, "an object of CPU fractions")
                service.register_worker(host, address, devices, throttle)
                return 200, {"ok": True}
            if match := re.fullmatch(r"/workers/([^/]+)/heartbeat", route):
                running = field(body, route, "running", (dict,), "an object", default={})
                if not all(re.fullmatch(r"\d{1,12}", k) and (v is None or type(v) is int) for k, v in running.items()):
                    raise ConfigError(f"POST {route} needs 'running' as job ids with exit codes or null; use "
                                      "tools/cluster.py worker.")
                messages = service.heartbeat(match[1], running)
                if messages is None:
                    return 404, {"error": f"worker {match[1]} is not registered; register again."}
                return 200, {"messages": messages}
            if match := re.fullmatch(r"/leases/(\d+)/(\d+)", route):
                for key, kinds, what in (("iteration", (int,), "an integer"), ("seconds_per_iteration", NUMBER,
                                         "a number"), ("renew", (bool,), "true or false"),
                                         ("exiting", (bool,), "true or false")):
                    if key in body:
                        field(body, route, key, kinds, what)
                if "stragglers" in body and not all(
                        type(s) is dict and type(s.get("rank")) is int and type(s.get("host")) is str
                        and s.get("phase") in ("compute", "communication")
                        and all(type(s.get(k)) in NUMBER for k in ("seconds", "peers_seconds", "slower"))
                        for s in field(body, route, "stragglers", (list,), "a list")):
                    raise ConfigError(f"POST {route} needs 'stragglers' as objects with an integer rank, a host, a "
                                      "phase (compute or communication) and seconds, peers_seconds and slower as "
                                      "numbers; megapipe's lease client sends them.")
                answer = service.lease_report(int(match[1]), int(match[2]), body)
                return (404 if "error" in answer else 200), answer
            return 404, {"error": f"{route} is not a route of this scheduler; use tools/cluster.py."}

    return Handler
