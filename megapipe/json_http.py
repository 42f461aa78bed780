"""JSON over HTTP for megapipe's two services (the cluster scheduler and the text-generation server):
a request body read within bounds, JSON answers, and one sentence for each way a request can be wrong.

Both run on ``http.server``, which reads nothing of a body by itself: the length comes from
``Content-Length`` (a chunked body is refused: neither client sends one), is checked against the
service's limit before a byte is read, and a body that stops short is refused once the handler's
socket timeout passes, so a client can neither make the service read without end nor hold it by
sending nothing. ``JsonHandler`` is the plumbing both services' handlers share: the bounded body,
the JSON answer, http.server's own refusals as JSON too, and one log line per request.

A refused request may leave body bytes unread, still arriving. Closing a socket with unread bytes
makes the kernel reset the connection, and a client still sending can then lose the answer it
was about to read. So the connection closes in stages instead (RFC 9112, section 9.6): the answer
is sent, the write side shut, what the client still sends read and dropped up to a bound
(``drain_bytes``, within ``drain_seconds``), and only then the socket closed; every refused client
reads its sentence.
"""

from __future__ import annotations

import abc
import json
import socket
import time
from http.server import BaseHTTPRequestHandler
from typing import Optional

# the JSON value a Python value came from, as a refusal names it
JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


class Refusal(Exception):
    """An HTTP answer other than 200: ``status``, one sentence (``str``) and extra headers."""

    def __init__(self, status: int, sentence: str, headers: tuple = ()):
        super().__init__(sentence)
        self.status, self.headers = status, headers


def body_length(headers, limit_text: str, limit: int, required: bool) -> int:
    """The body's byte count from ``headers``; Refusal when it is chunked, not a count, or over ``limit``
    (``limit_text`` names it: a flag, or the service's limit). A missing length is a refusal (411) when
    ``required``, else no body."""
    if headers.get("Transfer-Encoding"):
        raise Refusal(411, "a chunked body is not accepted; send the body with a Content-Length.")
    text: Optional[str] = headers.get("Content-Length")
    if text is None:
        if required:
            raise Refusal(411, "the request has no Content-Length header; send the body's length in bytes.")
        return 0
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        raise Refusal(400, f"Content-Length {text[:40]!r} is not a byte count; send the body's length in bytes.")
    digits = text.lstrip("0") or "0"
    if len(digits) > 18 or int(digits) > limit:  # no int() of thousands of digits
        shown = digits if len(digits) <= 20 else digits[:17] + "..."
        raise Refusal(413, f"the body of {shown} bytes exceeds {limit_text}; send a smaller request.")
    return int(digits)


def read_body(stream, length: int, waited: str) -> bytes:
    """``length`` bytes of ``stream``; Refusal when fewer arrive before the socket's timeout (``waited``
    says how long that is) or the end of the connection."""
    try:
        data = stream.read(length)
    except OSError:  # the socket's timeout: the client stopped sending
        data = b""
    if len(data) < length:
        raise Refusal(400, f"the body stopped short of the {length} bytes its Content-Length announced (nothing "
                           f"more came for {waited} or the connection closed); send the whole body.")
    return data


def json_object(data: bytes, example: str) -> dict:
    """The JSON object ``data`` holds; Refusal (400) says what it is instead (``example``: a good one)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Refusal(400, f"the body is not UTF-8 (byte {data[error.start]:#04x} at offset {error.start}); send "
                           "JSON text in UTF-8.") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise Refusal(400, f"the body is not JSON ({error.msg} at character {error.pos}); send a JSON object such "
                           f"as {example}.") from None
    except RecursionError:
        raise Refusal(400, "the body's JSON nests too deeply; send a flat JSON object.") from None
    if not isinstance(value, dict):
        raise Refusal(400, f"the body is {JSON_KINDS.get(type(value), 'a value')}, not a JSON object; send an "
                           f"object such as {example}.")
    return value


class JsonHandler(BaseHTTPRequestHandler, abc.ABC):
    """A handler that reads bounded JSON bodies and answers JSON; a service's handler subclasses it and
    sets its bounds, how its refusals name them, and its sentences for a malformed request."""

    timeout: float  # the connection's socket timeout: a client that stops sending is not waited for
    max_body_bytes: int
    limit_text: str  # how a refusal names max_body_bytes (a flag, or the service's limit)
    waited_text: str  # how a refusal names the timeout
    body_required = False  # a request without Content-Length is refused (411) rather than read as empty
    logs_requests = True  # one line per request on stdout, a refusal with its reason
    refusal = None  # the reason of the answer being sent, for its log line
    drain_bytes = 64 << 20  # at most this much of a refused body is read and dropped before closing
    drain_seconds = 10.0  # for at most this long
    body_left = False  # a refusal left body bytes unread: close in stages (``finish``)

    def read_json_body(self) -> bytes:
        """The request's body: at most ``max_body_bytes``, all of its Content-Length, within ``timeout``."""
        try:
            length = body_length(self.headers, self.limit_text, self.max_body_bytes, self.body_required)
            return read_body(self.rfile, length, self.waited_text)
        except Refusal:
            self.close_connection = True  # what is left of the body would be read as the next request
            self.body_left = True
            raise

    def send_json(self, status: int, payload: dict, headers: tuple = ()) -> None:
        self.refusal = payload.get("error")
        self.send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def send_refusal(self, refusal: Refusal) -> None:
        self.send_json(refusal.status, {"error": str(refusal)}, refusal.headers)

    def send_bytes(self, status: int, data: bytes, content_type: str, headers: tuple = ()) -> None:
        if self.request_version not in ("HTTP/1.0", "HTTP/1.1"):  # an answer to HTTP/0.9 or a broken line
            self.request_version = "HTTP/1.0"  # has a status line and headers too
        try:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client left before its answer
            self.close_connection = True

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals in JSON: a method without a ``do_`` method (501) is the service's
        ``refuse_method``; a malformed request line or header, or an HTTP version of 2 and above (505),
        is the client's fault: 400 with the service's ``malformed`` sentence."""
        self.close_connection = self.body_left = True
        if code == 501:
            return self.refuse_method()
        self.send_json(code if code < 500 else 400, {"error": self.malformed(code, message)})

    def finish(self):
        if self.body_left:
            self._drain()
        super().finish()

    def _drain(self) -> None:
        """After a refusal's answer: shut the write side, then read and drop what the client still sends
        until it closes, ``drain_bytes`` are dropped or ``drain_seconds`` pass (module docstring)."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            deadline, left = time.monotonic() + self.drain_seconds, self.drain_bytes
            while left > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self.connection.settimeout(remaining)
                dropped = self.rfile.read1(min(left, 1 << 16))
                if not dropped:
                    return
                left -= len(dropped)
        except OSError:  # the client reset or stopped sending: nothing more to wait for
            return

    @abc.abstractmethod
    def refuse_method(self) -> None:
        """The answer to a method this service does not serve."""

    @abc.abstractmethod
    def malformed(self, code: int, message: Optional[str]) -> str:
        """The sentence for a request http.server could not parse (``code`` and ``message``: its own)."""

    def log_request(self, code="-", size="-"):
        reason = f" {self.refusal}" if self.refusal else ""
        self.log_message('"%s" %s %s%s', self.requestline, str(getattr(code, "value", code)), size, reason)

    def log_message(self, fmt, *args):
        if self.logs_requests:
            print(f"{self.address_string()} {fmt % args}", flush=True)
