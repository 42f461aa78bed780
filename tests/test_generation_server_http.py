"""The text-generation server's HTTP answers that need no model, through its handler on an in-memory
connection (no socket): another method than PUT is refused with 405, ``Allow: PUT`` and a JSON
sentence naming PUT; a refused request's log line carries the reason it was refused; a request stops at
end-of-text unless it names its stop tokens."""

import io
import json
from types import SimpleNamespace

import pytest

from megapipe.data.tokenizer import build_tokenizer
from megapipe.inference.server import make_handler, parse_generate

pytestmark = pytest.mark.unit


class Connection:
    """One client's bytes as the handler reads them, and what it writes back."""

    def __init__(self, request: bytes):
        self.request, self.sent = request, b""

    def makefile(self, mode, *args, **kwargs):
        return io.BytesIO(self.request)

    def sendall(self, data):
        self.sent += data


def exchange(method: str, path: str, body: bytes = b"") -> tuple[int, dict, dict]:
    """Status, headers and JSON body of the server's answer to one request."""
    connection = Connection(f"{method} {path} HTTP/1.0\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    make_handler(SimpleNamespace(tokenizer=None, config=None))(connection, ("10.0.0.7", 4242), None)
    head, _, payload = connection.sent.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), headers, json.loads(payload)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_another_method_than_put_is_405_in_json_naming_put(method, capsys):
    status, headers, body = exchange(method, "/api")
    assert status == 405 and headers["Allow"] == "PUT" and headers["Content-Type"] == "application/json"
    assert body == {"error": f"{method} is not served here; send PUT /api (generation) or PUT /loglikelihood "
                             "(scoring) with a JSON body."}
    assert capsys.readouterr().out == f'10.0.0.7 "{method} /api HTTP/1.0" 405 - {body["error"]}\n'


def test_a_refused_request_is_logged_with_its_reason(capsys):
    status, _, body = exchange("PUT", "/api", json.dumps({"prompts": ["hello"], "top_p": 2}).encode())
    assert status == 400 and body == {"error": "field 'top_p' is 2; it must be a number within [0, 1]."}
    assert capsys.readouterr().out == ('10.0.0.7 "PUT /api HTTP/1.0" 400 - field \'top_p\' is 2; it must be a '
                                       'number within [0, 1].\n')


def test_generation_stops_at_end_of_text_unless_the_request_names_its_stops():
    """As Megatron-LM's generation stops at the tokenizer's eod (and an exported model at its
    eos_token_id), a request without ``stop_token_ids`` stops there; ``[]`` asks for no stop."""
    tokenizer = build_tokenizer("ByteLevelTokenizer")
    end_of_text = tokenizer.special_id("eod")
    assert end_of_text is not None
    _, default = parse_generate({"prompts": ["The"]}, tokenizer)
    _, none = parse_generate({"prompts": ["The"], "stop_token_ids": []}, tokenizer)
    _, given = parse_generate({"prompts": ["The"], "stop_token_ids": [7, 9]}, tokenizer)
    assert (default.stop_tokens, none.stop_tokens, given.stop_tokens) == ((end_of_text,), (), (7, 9))
