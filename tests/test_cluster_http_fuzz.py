"""The scheduler's HTTP API under attack: unsigned, forged and replayed requests, and fuzzed ones.

One service for the module (no round loop, so nothing changes but what requests change), with a
queued job, behind the real HTTP server on a loopback port; requests go over raw sockets so that
their framing can be broken too. Every endpoint refuses a request without a token, with a wrong
one and a replayed one (401). Hypothesis then sends a few thousand requests: random and real
routes, methods, bodies (random bytes, non-UTF-8, JSON of every type, the routes' fields with
wrong types), framings (truncated, a bad or oversized Content-Length, chunked) and signatures
(none, valid, wrong secret, replayed, a lease's key, the page token). Each answer must be a 4xx
with one sentence, or 200 with the route's documented answer for a validly signed request; a
refused request must leave the journal, the queue and the workers as they were; the service
still answers at the end. ``serve`` refuses a non-loopback address without a secret.
"""

import json
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megapipe.lease.auth import SECRET_ENV, lease_key, page_token, sign
from megapipe.cluster.service.http_api import MAX_BODY_BYTES, serve
from megapipe.cluster.service.journal import Journal
from megapipe.cluster.service.local_cluster import TOOL
from megapipe.cluster.service.service import ClusterService

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

SECRET = b"fuzz-secret-0123456789abcdef0123"
JOB = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length",
       "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10", "--mock-data",
       "--vocab-size", "128"]
# what a 200 answer of each route holds (http_api.py's table)
DOCUMENTED = {"/status": {"jobs"}, "/jobs": {"id", "unplaceable"}, "cancel": {"ok"}, "/workers": {"ok"},
              "heartbeat": {"messages"}, "leases": ({"expires_in"}, {"stop"}, {"ok"})}
COUNTS: Counter = Counter()


class Scheduler:
    def __init__(self, service: ClusterService, port: int):
        self.service, self.port = service, port

    def state(self) -> tuple:
        """What a request may change: journal rows, the queue, the workers, cancellations."""
        rows = [(r.id, r.name, r.state, r.priority, tuple(r.command)) for r in self.service.journal.jobs()]
        with self.service.lock:
            return (rows, [j.job_id for j in self.service.source.pending], self.service.backend.nodes(),
                    sorted(job_id for job_id, record in self.service.jobs.items() if record.cancel_requested))

    def send(self, raw: bytes) -> tuple[int, bytes]:
        """Send ``raw`` (a whole HTTP request, however malformed) and read the answer to its end."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as connection:
            connection.sendall(raw)
            connection.shutdown(socket.SHUT_WR)  # what was not sent never comes: a short body ends here
            answer = b""
            while chunk := connection.recv(65536):
                answer += chunk
        if not answer:  # closed without a word: only for a request without a request line
            return 0, b""
        head, _, body = answer.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), body


def request(method: str, path: str, body: bytes = b"", key=SECRET, length=None, extra: dict = None) -> bytes:
    """An HTTP/1.1 request, signed with ``key`` (unsigned for None); ``length``: another Content-Length."""
    headers = {"Host": "scheduler", "Content-Length": str(len(body) if length is None else length)}
    if key is not None:
        headers.update(sign(key, method, "http://scheduler" + path, body))
    headers.update(extra or {})
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    service = ClusterService(Journal(str(work / "journal.db")), "max_min_fairness_perf", 10.0, str(work / "work"),
                             secret=SECRET)
    service.submit("queued", 1.0, JOB)
    server = serve(service, "127.0.0.1", 0, SECRET)
    try:
        yield Scheduler(service, server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        print(f"\nrequests by kind and answer: {dict(sorted(COUNTS.items()))}; total {sum(COUNTS.values())}")


def error_sentence(body: bytes) -> str:
    error = json.loads(body)["error"]
    assert isinstance(error, str) and error.endswith(".") and "\n" not in error and "Traceback" not in error
    return error


def test_every_endpoint_refuses_no_token_a_wrong_one_and_a_replay(scheduler):
    scheduler.service.register_worker("host-r", "127.0.0.1", {"fast": 1}, {})
    job = scheduler.service.submit("to-cancel", 1.0, JOB)
    endpoints = [("GET", "/", b""), ("GET", "/status", b""),
                 ("POST", "/jobs", json.dumps({"name": "new", "command": JOB}).encode()),
                 ("POST", f"/jobs/{job}/cancel", b"{}"),
                 ("POST", "/workers", b'{"host": "host-s", "address": "127.0.0.1", "devices": {"fast": 1}}'),
                 ("POST", "/workers/host-r/heartbeat", b'{"running": {}}'),
                 ("POST", f"/leases/{job}/1", b'{"iteration": 1}')]
    for method, path, body in endpoints:
        before = scheduler.state()
        for key in (None, b"not the secret"):
            code, answer = scheduler.send(request(method, path, body, key=key))
            assert code == 401 and error_sentence(answer), (method, path, key)
        assert scheduler.state() == before, (method, path)
        captured = request(method, path, body)
        assert scheduler.send(captured)[0] == 200, (method, path)
        after = scheduler.state()
        code, answer = scheduler.send(captured)
        assert (code, error_sentence(answer)) == (
            401, "the request was already received once (a replay); sign every request anew."), (method, path)
        assert scheduler.state() == after


def test_bad_framing_and_bodies_are_one_sentence_each_and_change_nothing(scheduler):
    before = scheduler.state()
    cases = [
        (request("POST", "/jobs", b'{"name": "x"}', length="12abc"),
         400, "Content-Length '12abc' is not a byte count; send the body's length in bytes."),
        (request("POST", "/jobs", b"{}", length=MAX_BODY_BYTES + 1),
         413, "the body of 1048577 bytes exceeds the scheduler's limit of 1048576 bytes; send a smaller request."),
        (request("POST", "/jobs", b'{"name": "x"}', length=100),
         400, "the body stopped short of the 100 bytes its Content-Length announced (nothing more came for 10 s or the "
              "connection closed); send the whole body."),
        (request("POST", "/jobs", b'{"name": "caf\xe9"}'),
         400, "the body is not UTF-8 (byte 0xe9 at offset 13); send JSON text in UTF-8."),
        (request("POST", "/jobs", b'["pretrain_gpt.py"]'),
         400, 'the body is an array, not a JSON object; send an object such as '
         '{"name": "gpt-small", "command": ["pretrain_gpt.py"]}.'),
        (request("POST", "/jobs", b'{"name": '),
         400, 'the body is not JSON (Expecting value at character 9); send a JSON object such as '
         '{"name": "gpt-small", "command": ["pretrain_gpt.py"]}.'),
        (request("POST", "/jobs", b"[" * 100000 + b"]" * 100000),
         400, "the body's JSON nests too deeply; send a flat JSON object."),
        (request("POST", "/jobs", b'{"name": 3, "command": []}'),
         400, "POST /jobs needs 'name' as a string; use tools/cluster.py."),
        (request("POST", "/jobs", json.dumps({"name": "a\nb", "command": JOB}).encode()),
         400, "--name 'a\\nb' contains the control character U+000A; give a name of plain visible characters."),
        (request("POST", "/jobs", json.dumps({"name": "x", "command": JOB + ["--vocab-file", "/etc/passwd"]})
                 .encode()),
         400, f"--vocab-file /etc/passwd is outside the paths this scheduler allows ({scheduler.service.roots[0]}); "
              "move it under one of them or start serve with --allowed-paths naming its directory."),
        (request("POST", "/jobs", json.dumps({"name": "x", "command": JOB, "strict": "yes"}).encode()),
         400, "POST /jobs needs 'strict' as true or false; use tools/cluster.py."),
        (request("POST", "/jobs", json.dumps({"name": "x", "command": JOB, "strict": True}).encode()),
         409, "--strict refused the job, which no registered worker type can hold now: no worker is registered "
              "(none has joined yet, or all were lost); start one with tools/cluster.py worker --scheduler HOST:PORT "
              "--secret-file SECRET --devices TYPE:N."),  # no round loop here: the workers were never looked at
        (request("POST", "/jobs", b"{}", extra={"Transfer-Encoding": "chunked"}),
         411, "a chunked body is not accepted; send the body with a Content-Length."),
        (request("PUT", "/jobs", b"{}"), 405, "PUT is not a method of this scheduler; use GET or POST."),
        (b"GET /status HTTP/9.9\r\n\r\n", 400, "Invalid HTTP version (9.9); send HTTP/1.1 as tools/cluster.py does."),
        (b"NONSENSE\r\n\r\n", 400, "Bad request syntax ('NONSENSE'); send HTTP/1.1 as tools/cluster.py does."),
    ]
    for raw, code, sentence in cases:
        answer = scheduler.send(raw)
        assert (answer[0], error_sentence(answer[1])) == (code, sentence), raw[:80]
    assert scheduler.state() == before


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                 max_size=4), max_leaves=12)
FIELDS = st.fixed_dictionaries({}, optional={
    key: JSON for key in ("name", "priority", "command", "strict", "host", "address", "devices", "throttle",
                          "running", "iteration", "seconds_per_iteration", "renew", "exiting")})
BODIES = st.one_of(st.binary(max_size=300), FIELDS.map(lambda d: json.dumps(d).encode()),
                   JSON.map(lambda v: json.dumps(v).encode()), st.just(b"\xff\xfe{}"), st.just(b""))
IDS = st.integers(min_value=0, max_value=4)
PATHS = st.one_of(
    st.sampled_from(["/", "/status", "/jobs", "/workers", "//", "/jobs/", "/status/", "/favicon.ico"]),
    IDS.map(lambda n: f"/jobs/{n}/cancel"), st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True).map(
        lambda h: f"/workers/{h}/heartbeat"), st.tuples(IDS, IDS).map(lambda t: f"/leases/{t[0]}/{t[1]}"),
    st.from_regex(r"/[A-Za-z0-9/._~%-]{0,60}", fullmatch=True))
METHODS = st.sampled_from(["GET"] * 4 + ["POST"] * 10 + ["PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO"])
SIGNING = st.sampled_from(["none", "valid", "wrong", "replay", "lease", "page"])
FRAMING = st.sampled_from(["exact", "exact", "exact", "truncated", "bad-length", "oversized", "garbage"])


def documented(route: str, value) -> bool:
    """Whether a 200 answer's JSON is what the route's table promises."""
    if route == "/status":
        return "jobs" in value
    kind = route if route in DOCUMENTED else next((k for k in ("cancel", "heartbeat", "leases") if k in route), None)
    shapes = DOCUMENTED.get(kind, ())
    return set(value) in (shapes if isinstance(shapes, tuple) else (shapes,))


@settings(max_examples=2000, deadline=None, database=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(method=METHODS, path=PATHS, body=BODIES, signing=SIGNING, framing=FRAMING, lease=st.tuples(IDS, IDS))
def test_fuzzed_requests_get_a_4xx_or_the_documented_answer_and_refusals_change_nothing(
        scheduler, method, path, body, signing, framing, lease):
    key = {"none": None, "wrong": b"a wrong secret", "lease": lease_key(SECRET, *lease), "page": None}.get(
        signing, SECRET)
    if signing == "page":
        path += f"?token={page_token(SECRET)}"
    length = {"truncated": len(body) + 7, "bad-length": "-1", "oversized": MAX_BODY_BYTES + 1}.get(framing)
    raw = body + b"\r\n\r\n" if framing == "garbage" else request(method, path, body, key=key, length=length)
    sends = [raw, raw] if signing == "replay" else [raw]
    for attempt, message in enumerate(sends):
        before = scheduler.state()
        code, answer = scheduler.send(message)
        COUNTS[f"{signing}/{code}"] += 1
        route = path.split("?")[0]
        route = "/" + route.lstrip("/") if route.startswith("//") else route  # as http.server reads it
        if code == 200:
            assert framing == "exact" and method in ("GET", "POST") and attempt == 0, (method, path, signing)
            assert signing in ("valid", "replay") or (signing == "lease" and route == "/leases/%d/%d" % lease) or (
                signing == "page" and method == "GET" and route in ("/", "/status")), (method, path, signing)
            if route != "/":
                assert documented(route, json.loads(answer)), (route, answer)
            continue
        if code == 0:  # no request line at all (e.g. an empty one): the connection is closed
            assert framing == "garbage" and not body.split(b"\n", 1)[0].decode("latin-1").split(), body
        else:
            assert 400 <= code < 500, (method, path, signing, framing, code, answer)
            error_sentence(answer)
        assert scheduler.state() == before, (method, path, body, signing, framing, code, answer)


def test_the_service_still_answers_after_the_fuzzing(scheduler):
    code, answer = scheduler.send(request("GET", "/status"))
    assert code == 200 and json.loads(answer)["jobs"][0]["name"] == "queued"


@pytest.mark.parametrize("flags, sentence", [
    (["--host", "0.0.0.0"], "error: serve --host 0.0.0.0 is reachable from other machines, so it needs a secret; "
                            f"pass --secret-file PATH (a file only you can read) or set {SECRET_ENV}."),
    (["--secret-file", "{open}"], "error: --secret-file {open} is readable by group or others; run chmod 600 {open}."),
])
def test_serve_refuses_to_start_without_a_secret_it_can_trust(tmp_path, flags, sentence):
    readable = tmp_path / "secret"
    readable.write_text("s3cret")
    readable.chmod(0o644)
    flags = [flag.format(open=readable) for flag in flags]
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    done = subprocess.run([sys.executable, TOOL, "serve", "--port", "0", "--journal", str(tmp_path / "j.db"),
                           "--policy", "max_min_fairness_perf", "--round-seconds", "5", *flags],
                          capture_output=True, text=True, timeout=120, env=env)
    assert (done.returncode, done.stderr.strip()) == (2, sentence.format(open=readable))
    assert not os.path.exists(tmp_path / "j.db")
