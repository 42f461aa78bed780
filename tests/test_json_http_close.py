"""A refused request's connection closes in stages (``json_http.JsonHandler``): a client still sending an
oversized body finishes sending and reads its sentence, instead of a reset; the drain is bounded in
bytes and in time. A real server on the loopback interface, a handler with no service behind it."""

from __future__ import annotations

import json
import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Optional

import pytest

from megapipe.json_http import JsonHandler, Refusal

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

LIMIT = 1000
BODY = 20_000_000  # well above the loopback socket buffers: the client is still sending when refused
SENTENCE = f"the body of {BODY} bytes exceeds the limit {LIMIT}; send a smaller request."


class Handler(JsonHandler):
    timeout = 10.0
    max_body_bytes = LIMIT
    limit_text = f"the limit {LIMIT}"
    waited_text = "10 s"
    logs_requests = False

    def do_PUT(self):
        try:
            self.read_json_body()
        except Refusal as refusal:
            self.send_refusal(refusal)
            return
        self.send_json(200, {})

    def refuse_method(self):
        self.send_json(405, {"error": "PUT only."})

    def malformed(self, code, message):
        return "a malformed request."


class Undrained(Handler):
    drain_bytes = 0  # closes with the body unread: what happened before the staged close


class ShortDrain(Handler):
    drain_seconds = 0.2
    finished = threading.Event()  # set once the handler has closed its connection

    def finish(self):
        super().finish()
        ShortDrain.finished.set()


def serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def server_of():
    started = []

    def start(handler):
        started.append(serve(handler))
        return started[-1][0].server_address[1]

    yield start
    for server, thread in started:
        server.shutdown()
        server.server_close()
        thread.join(10)


def oversized_put(port: int, body: int = BODY, send_body: bool = True) -> tuple[Optional[OSError], bytes]:
    """Send a PUT announcing ``body`` bytes (and, with ``send_body``, all of them, from another thread),
    then read the whole answer; the send's error, if any, and the bytes read until the server closed."""
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"PUT / HTTP/1.1\r\nHost: test\r\nContent-Length: {body}\r\n\r\n".encode()
    errors = []

    def send():
        try:
            client.sendall(head + (b"x" * body if send_body else b""))
        except OSError as error:
            errors.append(error)

    sender = threading.Thread(target=send)
    sender.start()
    sender.join(60)
    answer = b""
    try:
        while chunk := client.recv(1 << 16):
            answer += chunk
    except OSError as error:
        errors.append(error)
    finally:
        client.close()
    return (errors[0] if errors else None), answer


def sentence_of(answer: bytes) -> tuple[str, str]:
    head, _, payload = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), json.loads(payload)["error"]


def test_a_client_still_sending_finishes_and_reads_its_sentence(server_of):
    port = server_of(Handler)
    for _ in range(5):
        error, answer = oversized_put(port)
        assert error is None
        assert sentence_of(answer) == ("HTTP/1.0 413 Request Entity Too Large", SENTENCE)


def test_without_the_drain_the_sending_client_is_cut_off(server_of):
    """The check above can fail: a server that closes with the body unread breaks the client's send."""
    error, _ = oversized_put(server_of(Undrained))
    assert isinstance(error, (BrokenPipeError, ConnectionResetError))


def test_the_drain_is_bounded_in_bytes(server_of):
    class SmallDrain(Handler):
        drain_bytes = 1 << 20

    error, answer = oversized_put(server_of(SmallDrain))
    assert isinstance(error, (BrokenPipeError, ConnectionResetError))  # 20 MB sent, 1 MiB dropped, then closed


def test_the_drain_is_bounded_in_time_for_a_client_that_stops_sending(server_of):
    """Headers only, then silence with the connection held open: the answer comes, and the handler
    finishes after ``drain_seconds`` while the client still holds the connection (without the deadline
    it would wait for the client, here at least 20 s)."""
    port = server_of(ShortDrain)
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        client.sendall(f"PUT / HTTP/1.1\r\nHost: test\r\nContent-Length: {BODY}\r\n\r\n".encode())
        answer = b""
        while chunk := client.recv(1 << 16):  # the write side shut after the answer: end of stream
            answer += chunk
        assert sentence_of(answer) == ("HTTP/1.0 413 Request Entity Too Large", SENTENCE)
        assert ShortDrain.finished.wait(20)
    finally:
        client.close()
