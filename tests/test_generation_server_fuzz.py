"""The text-generation server under Hypothesis: about a thousand malformed, oversized, truncated,
non-UTF-8 and wrongly typed requests, random paths and methods, sent to ONE server over raw sockets.

Every request has a client timeout: an answer that does not come is a hang, a connection closed
without an answer a crash. Each answer is 200 (a request within the limits) or a 4xx with a JSON
``error`` of one sentence; a burst of concurrent requests gets 200 or 503 with ``Retry-After``; at
the end the server still answers a good request as before. Run with ``-s`` to see the counts.
"""

import json
import math
import socket
import threading
import urllib.parse
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from server_helpers import WORDS, serving, tiny_checkpoint

pytestmark = pytest.mark.system

MAX_BYTES, MAX_PROMPTS, MAX_TOKENS, MAX_NEW = 2048, 3, 12, 6
LIMITS = ("--max-request-bytes", str(MAX_BYTES), "--max-prompts", str(MAX_PROMPTS), "--max-prompt-tokens",
          str(MAX_TOKENS), "--max-tokens-to-generate", str(MAX_NEW), "--read-timeout-seconds", "0.5",
          "--max-queued-requests", "2")
CLIENT_TIMEOUT = 30.0  # far above any answer's time: reaching it is a hang
REFUSALS = {400, 404, 405, 411, 413}
TALLY = Counter()  # requests tried, answers by status, crashes, hangs
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    _, checkpoint = tiny_checkpoint(tmp_path_factory.mktemp("fuzz"))
    with serving(checkpoint, *LIMITS) as (url, _):
        parts = urllib.parse.urlsplit(url)
        yield parts.hostname, parts.port


def exchange(address, raw: bytes, finish_sending: bool = True) -> tuple[int, dict, dict]:
    """Status, headers and JSON answer of one raw request. ``finish_sending``: half-close after sending,
    so that a short body ends at once (else the server's read timeout ends it)."""
    TALLY["requests"] += 1
    with socket.create_connection(address, timeout=CLIENT_TIMEOUT) as connection:
        connection.sendall(raw)
        if finish_sending:
            connection.shutdown(socket.SHUT_WR)
        data = b""
        try:
            while chunk := connection.recv(65536):
                data += chunk
        except TimeoutError:
            TALLY["hangs"] += 1
            raise AssertionError(f"no answer within {CLIENT_TIMEOUT} s to {raw[:200]!r}") from None
    if not data:
        TALLY["crashes"] += 1
        raise AssertionError(f"the connection closed without an answer to {raw[:200]!r}")
    head, _, payload = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split()[1])
    TALLY[status] += 1
    return status, dict(line.split(": ", 1) for line in header_lines), json.loads(payload)


def request(method: str, path: str, body: bytes = b"", length=None) -> bytes:
    """The bytes of an HTTP/1.0 request; ``length``: the Content-Length header's text (None: the body's, "": none)."""
    length = str(len(body)) if length is None else length
    header = f"Content-Length: {length}\r\n" if length != "" else ""
    return f"{method} {path} HTTP/1.0\r\nContent-Type: application/json\r\n{header}\r\n".encode() + body


def assert_refusal(status: int, answer: dict) -> None:
    assert status in REFUSALS, (status, answer)
    assert set(answer) == {"error"} and answer["error"].endswith(".") and "\n" not in answer["error"], answer


def assert_answer(status: int, answer: dict, body) -> None:
    """A 200 answers each prompt (or pair) in the body; anything else is a refusal."""
    if status != 200:
        return assert_refusal(status, answer)
    if "requests" in body:
        assert len(answer["loglikelihoods"]) == len(body["requests"])
    else:
        assert len(answer["text"]) == len(answer["tokens"]) == len(body["prompts"]) and not answer["cut_at_deadline"]
        assert all(len(t) <= body.get("tokens_to_generate", MAX_NEW) for t in answer["tokens"])


words = st.lists(st.sampled_from(WORDS), min_size=0, max_size=MAX_TOKENS + 2).map(" ".join)
texts = words | st.text(max_size=30)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | texts,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=12)
numbers = st.integers(-3, 2 ** 70) | st.floats(allow_nan=True, allow_infinity=True)
generate_bodies = st.fixed_dictionaries({}, optional={
    "prompts": st.lists(texts, max_size=MAX_PROMPTS + 1) | json_values,
    "tokens_to_generate": st.integers(-2, MAX_NEW + 2) | json_values,
    "temperature": numbers | json_values, "top_k": numbers, "top_p": numbers, "random_seed": numbers,
    "repetition_penalty": numbers, "stop_token_ids": st.lists(st.integers(-3, 2 ** 70), max_size=3) | json_values,
    "max_tokens": st.integers()})
score_bodies = st.fixed_dictionaries({"requests": st.lists(st.lists(texts, max_size=3), max_size=MAX_PROMPTS + 1)
                                      | json_values})
some_words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=MAX_TOKENS + 1).map(" ".join)
good_bodies = st.fixed_dictionaries({"prompts": st.lists(some_words, min_size=1, max_size=MAX_PROMPTS + 1)}, optional={
    "tokens_to_generate": st.integers(1, MAX_NEW + 1), "temperature": st.floats(0, 2), "top_k": st.integers(0, 30),
    "top_p": st.floats(0, 1), "random_seed": st.integers(0, 2 ** 32 - 1), "repetition_penalty": st.floats(0.5, 2),
    "stop_token_ids": st.lists(st.integers(0, len(WORDS) - 1), max_size=2)}) | st.fixed_dictionaries({
        "requests": st.lists(st.tuples(some_words, some_words).map(list), min_size=1, max_size=MAX_PROMPTS + 1)})


@settings(FUZZ, max_examples=500)
@given(body=good_bodies | generate_bodies | score_bodies | json_values,
       path=st.sampled_from(["/api", "/loglikelihood"]))
def test_json_bodies_of_any_shape_get_an_answer_or_one_sentence(address, body, path):
    status, _, answer = exchange(address, request("PUT", path, json.dumps(body).encode()))
    if not isinstance(body, dict) or ("requests" in body) != (path == "/loglikelihood"):
        return assert_refusal(status, answer)
    assert_answer(status, answer, body)


@settings(FUZZ, max_examples=200)
@given(body=generate_bodies, encoding=st.sampled_from(["utf-16", "utf-32", "latin-1", "cp1252"]),
       noise=st.binary(min_size=1, max_size=200))
def test_bodies_that_are_not_utf8_json_are_refused(address, body, encoding, noise):
    text = json.dumps(body, ensure_ascii=False)
    encoded = text.encode(encoding, errors="replace")
    for raw in (encoded, b"\xff" + noise):
        if raw == text.encode("utf-8"):  # plain ASCII stays UTF-8 in latin-1 and cp1252
            continue
        assert_refusal(*exchange(address, request("PUT", "/api", raw))[::2])


def announced_bytes(text: str):
    """The byte count a Content-Length of ``text`` announces (inf beyond 18 digits), None if it is no number."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"
    return math.inf if len(digits) > 18 else int(digits)


@settings(FUZZ, max_examples=200)
@given(body=st.binary(max_size=100), announced=st.integers(0, 3 * MAX_BYTES) | st.integers(0, 10 ** 30)
       | st.text(max_size=8) | st.just("") | st.text("0123456789", min_size=19, max_size=40)
       | st.integers(4000, 6000).map(lambda n: "9" * n))  # beyond what int() takes from a string
def test_any_content_length_gets_its_refusal(address, body, announced):
    """Missing (411), not a number (400), above the limit (413, the body never sent), above what is sent (400)."""
    text = str(announced)
    count = announced_bytes(text)
    too_big = count is not None and count > MAX_BYTES
    status, _, answer = exchange(address, request("PUT", "/api", b"" if too_big else body, text))
    assert_refusal(status, answer)
    if text == "":
        assert status == 411
    elif too_big:
        assert status == 413 and f"--max-request-bytes {MAX_BYTES}" in answer["error"]
    elif count is not None and count > len(body):
        assert status == 400 and "stopped short" in answer["error"]


@settings(FUZZ, max_examples=6)
@given(sent=st.integers(0, 20), missing=st.integers(1, 100))
def test_a_body_that_stops_without_closing_is_refused_after_the_read_timeout(address, sent, missing):
    raw = request("PUT", "/api", b" " * sent, str(sent + missing))
    status, _, answer = exchange(address, raw, finish_sending=False)
    assert status == 400 and "stopped short" in answer["error"]


methods = st.sampled_from(["GET", "PUT", "POST", "DELETE", "PATCH", "HEAD", "OPTIONS"]) | st.from_regex(
    r"[A-Z]{1,12}", fullmatch=True)
paths = st.sampled_from(["/api", "/loglikelihood", "/", "/api/", "/API"]) | st.text(
    st.characters(min_codepoint=33, max_codepoint=0x2FFF), max_size=40).map(lambda p: "/" + p)


@settings(FUZZ, max_examples=250)
@given(method=methods, path=paths, body=st.sampled_from([b"", b'{"prompts": ["the cat"], "tokens_to_generate": 2}']))
def test_any_method_and_path_gets_405_404_or_the_endpoint(address, method, path, body):
    """A request line that splits into more than three words (a path with a character that latin-1 reads as
    white space) is malformed: 400."""
    status, headers, answer = exchange(address, request(method, path, body))
    if status == 400 and answer["error"].startswith("the request is malformed"):
        assert len(f"{method} {path} HTTP/1.0".encode().decode("latin-1").split()) != 3
    elif method != "PUT":
        assert status == 405 and headers["Allow"] == "PUT", (status, answer)
    elif path not in ("/api", "/loglikelihood"):
        assert status == 404, (status, answer)
    if status != 200:
        assert_refusal(status, answer)


def test_a_burst_of_concurrent_requests_gets_answers_or_503(address):
    """Requests arriving together run one at a time; those beyond the queue get 503 with Retry-After."""
    good = request("PUT", "/api", json.dumps({"prompts": ["the cat sat"], "tokens_to_generate": 4,
                                               "top_k": 1}).encode())
    answers = [None] * 12

    def send(i):
        answers[i] = exchange(address, good)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(answers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CLIENT_TIMEOUT + 5)
    assert all(a is not None for a in answers), "a request of the burst got no answer"
    served = [a[2] for a in answers if a[0] == 200]
    assert served and all(a == served[0] for a in served)
    for status, headers, answer in answers:
        assert status == 200 or (status == 503 and headers["Retry-After"] == "1"
                                 and "--max-queued-requests 2" in answer["error"]), (status, answer)


def test_the_server_still_answers_a_good_request_at_the_end(address):
    status, _, answer = exchange(address, request("PUT", "/api", json.dumps(
        {"prompts": ["the cat sat", "a dog"], "tokens_to_generate": 3, "top_k": 1}).encode()))
    assert status == 200 and [len(t) for t in answer["tokens"]] == [3, 3]
    print(f"\nfuzzed the server: {TALLY['requests']} requests, crashes {TALLY['crashes']}, hangs {TALLY['hangs']}, "
          f"answers by status {dict(sorted((k, v) for k, v in TALLY.items() if isinstance(k, int)))}")
    assert TALLY["crashes"] == TALLY["hangs"] == 0
