"""A JSON request body read within bounds, for megapipe's two HTTP services (the cluster scheduler
and the text-generation server), with one sentence for each way a body can be wrong.

Both run on ``http.server``, which reads nothing of a body by itself: the length comes from
``Content-Length`` (a chunked body is refused: neither client sends one), is checked against the
service's limit before a byte is read, and a body that stops short is refused once the handler's
socket timeout passes, so a client can neither make the service read without end nor hold it by
sending nothing.
"""

from __future__ import annotations

import json
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
