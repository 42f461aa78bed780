"""The text-generation server's HTTP answers that need no model, through its handler on an in-memory
connection (no socket): another method than PUT is refused with 405, ``Allow: PUT`` and a JSON
sentence naming PUT; a refused request's log line carries the reason it was refused; a request stops at
end-of-text unless it names its stop tokens; each limit, a body that is not UTF-8 JSON holding an
object, a short body and a full queue are refused with their status and one sentence naming the flag;
a queued request given up at its deadline is passed over by the worker."""

import argparse
import io
import itertools
import json
import threading
from types import SimpleNamespace

import pytest

from megapipe.data.tokenizer import build_tokenizer
from megapipe.inference.request_queue import Job, QueueFull, RequestQueue
from megapipe.inference.server import make_handler, parse_generate
from megapipe.inference.server_limits import ServerLimits, add_limit_flags

pytestmark = pytest.mark.unit


class Connection:
    """One client's bytes as the handler reads them, and what it writes back."""

    def __init__(self, request: bytes):
        self.request, self.sent, self.shut = request, b"", None

    def makefile(self, mode, *args, **kwargs):
        return io.BytesIO(self.request)

    def settimeout(self, seconds):
        self.timeout = seconds

    def sendall(self, data):
        self.sent += data

    def shutdown(self, how):
        self.shut = how


LIMITS = ServerLimits(max_request_bytes=200, max_prompts=2, max_prompt_tokens=8, max_tokens_to_generate=5,
                      max_queued_requests=1)
MODEL = SimpleNamespace(tokenizer=build_tokenizer("ByteLevelTokenizer"),
                        config=SimpleNamespace(max_position_embeddings=64, vocab_size=300))


class Full:
    def submit(self, job):
        raise QueueFull


def exchange(method: str, path: str, body: bytes = b"", length=None, jobs=None, clock=None) -> tuple[int, dict, dict]:
    """Status, headers and JSON body of the server's answer to one request (by default its queue is full)."""
    length = len(body) if length is None else length
    headers = "" if length == "" else f"Content-Length: {length}\r\n"
    connection = Connection(f"{method} {path} HTTP/1.0\r\nContent-Type: application/json\r\n{headers}"
                            "\r\n".encode() + body)
    handler = make_handler(MODEL, LIMITS, jobs or Full(), **({"clock": clock} if clock else {}))
    handler(connection, ("10.0.0.7", 4242), None)
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


@pytest.mark.parametrize("body, length, status, message", [
    (b"", 201, 413, "the body of 201 bytes exceeds --max-request-bytes 200; send a smaller request."),
    (b"", "9" * 5000, 413, "the body of 99999999999999999... bytes exceeds --max-request-bytes 200; send a "
                           "smaller request."),
    (b"", "", 411, "the request has no Content-Length header; send the body's length in bytes."),
    (b"{}", "2x", 400, "Content-Length '2x' is not a byte count; send the body's length in bytes."),
    (b'{"prompts"', 30, 400, "the body stopped short of the 30 bytes its Content-Length announced (nothing more "
                             "came for --read-timeout-seconds 10 or the connection closed); send the whole body."),
    (b'{"prompts": ["\xff"]}', None, 400, "the body is not UTF-8 (byte 0xff at offset 14); send JSON text in "
                                          "UTF-8."),
    (b'["hello"]', None, 400, 'the body is an array, not a JSON object; send an object such as {"prompts": '
                              '["Hello"]}.'),
    (b"[" * 150, None, 400, 'the body is not JSON (Expecting value at character 150); send a JSON object such as '
                            '{"prompts": ["Hello"]}.'),
    (b'{"prompts": ["a", "b", "c"]}', None, 400, "3 prompts exceed --max-prompts 2; send at most 2 per request."),
    (b'{"prompts": ["abcdefghi"]}', None, 400, "a prompt of 9 tokens exceeds --max-prompt-tokens 8; shorten it."),
    (b'{"prompts": ["a"], "tokens_to_generate": 6}', None, 400,
     "tokens_to_generate 6 exceeds --max-tokens-to-generate 5; ask for fewer tokens."),
    (b'{"prompts": ["\\ud800"]}', None, 400, "field 'prompts' is ['\\ud800']; it must be a non-empty list of "
                                               "non-empty strings (without lone surrogates)."),
    (b'{"prompts": ["a"], "random_seed": 18446744073709551616}', None, 400,
     "field 'random_seed' is 18446744073709551616; it must be an integer within [0, 2**32)."),
    (b'{"requests": [["a", "b"], ["c", "d"], ["e", "f"]]}', None, 400,
     "3 requests exceed --max-prompts 2; send at most 2 per request."),
    (b'{"prompts": ["a"]}', None, 503, "the server is busy: --max-queued-requests 1 requests already wait; retry "
                                       "later."),
])
def test_each_bound_is_refused_with_its_status_and_one_sentence(body, length, status, message):
    path = "/loglikelihood" if b"requests" in body else "/api"
    answer_status, headers, answer = exchange("PUT", path, body, length)
    assert (answer_status, answer) == (status, {"error": message})
    assert headers.get("Retry-After") == ("1" if status == 503 else None)


def test_a_scoring_pair_longer_than_the_token_limit_is_refused():
    status, _, answer = exchange("PUT", "/loglikelihood", b'{"requests": [["abcde", "fghij"]]}')
    assert (status, answer) == (400, {"error": "a context and continuation of 10 tokens exceeds --max-prompt-tokens "
                                               "8; shorten it."})


def test_an_unknown_method_is_405_in_json_not_an_html_501():
    status, headers, answer = exchange("BREW", "/api")
    assert status == 405 and headers["Allow"] == "PUT" and answer["error"].startswith("BREW is not served here")


def test_the_worker_passes_over_a_request_given_up_at_its_deadline():
    """A request still queued at its deadline is given up by its connection; the worker then takes the
    next one, in arrival order, and a full queue refuses another."""
    jobs = RequestQueue(2)
    late, on_time = jobs.submit(Job(("late",), deadline=5.0)), jobs.submit(Job(("on time",), deadline=50.0))
    with pytest.raises(QueueFull):
        jobs.submit(Job(("third",), deadline=50.0))
    assert late.wait(clock=lambda: 6.0) is False  # past its deadline, not started: given up at once
    assert jobs.next() is on_time
    on_time.finish("answer")
    assert on_time.wait(clock=itertools.count().__next__) is True and on_time.result == "answer"


def test_a_request_still_queued_at_its_deadline_gets_504():
    """Nobody serves the queue and the clock has passed the deadline when the connection waits."""
    clock = itertools.count(step=LIMITS.request_timeout_seconds).__next__
    status, _, answer = exchange("PUT", "/api", b'{"prompts": ["a"]}', jobs=RequestQueue(1), clock=clock)
    assert (status, answer) == (504, {"error": "the request waited in the queue past its deadline "
                                               "(--request-timeout-seconds 300.0); retry later."})


def test_a_generation_cut_at_its_deadline_answers_what_it_has_and_says_so():
    jobs, ran = RequestQueue(1), []

    def worker():  # what every rank ran: one new token per prompt, then the deadline
        job = jobs.next()
        ran.append(job.command[:2])
        job.finish(([[100], [101]], True))

    thread = threading.Thread(target=worker)
    thread.start()
    status, _, answer = exchange("PUT", "/api", b'{"prompts": ["a", "bc"], "tokens_to_generate": 5}', jobs=jobs)
    thread.join(30)
    assert ran == [("generate", [[97], [98, 99]])]
    assert (status, answer) == (200, {"text": ["ad", "bce"], "tokens": [[100], [101]], "cut_at_deadline": True})


@pytest.mark.parametrize("flags", [["--max-prompts", "0"], ["--request-timeout-seconds", "nan"],
                                   ["--read-timeout-seconds", "inf"], ["--max-request-bytes", "1e3"]])
def test_a_limit_must_be_a_positive_finite_number(flags, capsys):
    parser = argparse.ArgumentParser()
    add_limit_flags(parser)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(flags)
    assert exit_.value.code == 2 and f"{flags[0]}: {flags[1]!r} is not a positive finite" in capsys.readouterr().err
    assert ServerLimits.from_args(parser.parse_args([])) == ServerLimits()
