"""The cluster's signed requests (``megapipe/lease/auth.py``), without a server.

A request signed with the secret passes once: sent again (a replay), with another method, path,
body or secret, or with a stale timestamp, it is refused. A lease's key signs its own route and
nothing else; the status page's token opens GET / and GET /status only. The secret file must be
the owner's alone, and a missing or empty one is refused in one sentence.
"""

import os

import pytest
from hypothesis import given, settings, strategies as st

from megapipe.lease import auth
from megapipe.lease.auth import ReplayGuard, lease_key, page_token, sign
from megapipe.errors import ConfigError

pytestmark = pytest.mark.unit

SECRET = b"0123456789abcdef0123456789abcdef"
SCHEDULER = "http://127.0.0.1:8470"


def check(guard, method, path, body=b"", key=SECRET, headers=None):
    """The guard's refusal (None: accepted) of a request signed with ``key`` (or sent with ``headers``)."""
    return guard.refusal(method, path, sign(key, method, SCHEDULER + path, body) if headers is None else headers,
                         body)


def test_a_signed_request_passes_once_and_any_change_is_refused():
    guard = ReplayGuard(SECRET)
    headers = sign(SECRET, "POST", SCHEDULER + "/jobs", b'{"name": "a"}')
    assert guard.refusal("POST", "/jobs", headers, b'{"name": "a"}') is None
    assert guard.refusal("POST", "/jobs", headers, b'{"name": "a"}') == (
        401, "the request was already received once (a replay); sign every request anew.")
    mismatch = (401, "the request's signature does not match; sign it with the scheduler's secret (--secret-file, "
                     "the same file serve uses).")
    fresh = lambda: sign(SECRET, "POST", SCHEDULER + "/jobs", b'{"name": "a"}')  # noqa: E731
    assert guard.refusal("POST", "/jobs", fresh(), b'{"name": "b"}') == mismatch
    assert guard.refusal("POST", "/jobs/0/cancel", fresh(), b'{"name": "a"}') == mismatch
    assert guard.refusal("GET", "/jobs", fresh(), b'{"name": "a"}') == mismatch
    assert check(guard, "POST", "/jobs", key=b"another secret") == mismatch
    assert check(guard, "GET", "/status", headers={})[0] == 401  # no token at all
    unsigned = check(guard, "POST", "/jobs", headers={})
    assert unsigned == (401, "POST /jobs needs a signed request (X-Megapipe-Timestamp, X-Megapipe-Nonce, "
                             "X-Megapipe-Signature); pass --secret-file to tools/cluster.py or set "
                             "MEGAPIPE_CLUSTER_SECRET.")


def test_a_stale_or_future_timestamp_is_refused(monkeypatch):
    guard = ReplayGuard(SECRET)
    headers = sign(SECRET, "GET", SCHEDULER + "/status")
    monkeypatch.setattr(auth.time, "time", lambda: float(headers[auth.TIMESTAMP]) + 61)
    assert guard.refusal("GET", "/status", headers, b"") == (
        401, "the request's X-Megapipe-Timestamp is not within 60 s of the scheduler's clock; synchronise the "
             "hosts' clocks (NTP) and sign each request when it is sent.")
    monkeypatch.setattr(auth.time, "time", lambda: float(headers[auth.TIMESTAMP]) - 61)
    assert guard.refusal("GET", "/status", headers, b"")[0] == 401
    for bad in ("nan", "inf", "soon"):
        assert guard.refusal("GET", "/status", {**headers, auth.TIMESTAMP: bad}, b"")[0] == 401


def test_remembered_nonces_are_bounded_and_forgotten_once_their_timestamps_expire(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    guard = ReplayGuard(SECRET, capacity=3)
    assert [check(guard, "GET", "/status") for _ in range(3)] == [None] * 3
    assert check(guard, "GET", "/status") == (429, "the scheduler received more than 3 signed requests in 120 s; "
                                                   "send fewer and retry in a minute.")
    now[0] += 121  # every remembered timestamp is out of the window: their nonces can go
    assert check(guard, "GET", "/status") is None and len(guard.seen) == 1


def test_a_lease_key_signs_its_own_route_only():
    guard = ReplayGuard(SECRET)
    key = lease_key(SECRET, 3, 2)
    assert check(guard, "POST", "/leases/3/2", b'{"iteration": 1}', key=key) is None
    for path in ("/leases/3/1", "/leases/4/2", "/jobs", "/jobs/3/cancel", "/workers/a/heartbeat", "/status"):
        assert check(guard, "POST", path, key=key)[0] == 401, path
    assert check(guard, "GET", "/status", key=key)[0] == 401
    assert check(guard, "POST", "/leases/3/2", key=SECRET) is None  # the secret itself signs everything


def test_the_status_page_token_opens_the_two_pages_only():
    guard = ReplayGuard(SECRET)
    token = page_token(SECRET)
    assert guard.refusal("GET", f"/?token={token}", {}, b"") is None
    assert guard.refusal("GET", f"/status?token={token}", {}, b"") is None
    assert guard.refusal("GET", f"/status?token={token}", {}, b"") is None  # a browser reloads the same address
    assert guard.refusal("GET", "/?token=" + "0" * 64, {}, b"")[0] == 401
    assert guard.refusal("GET", f"/?token={page_token(b'another')}", {}, b"")[0] == 401
    for method, path in (("POST", "/jobs"), ("POST", "/jobs/0/cancel"), ("POST", "/"), ("GET", "/jobs")):
        assert guard.refusal(method, f"{path}?token={token}", {}, b"")[0] == 401, (method, path)


@settings(max_examples=200, deadline=None)
@given(method=st.sampled_from(["GET", "POST"]), path=st.from_regex(r"/[a-z0-9/]{0,30}", fullmatch=True),
       body=st.binary(max_size=200), flip=st.integers(min_value=0))
def test_one_flipped_bit_of_a_signed_body_is_refused(method, path, body, flip):
    guard = ReplayGuard(SECRET)
    headers = sign(SECRET, method, SCHEDULER + path, body)
    if body:
        index = flip % (8 * len(body))
        tampered = bytearray(body)
        tampered[index // 8] ^= 1 << (index % 8)
        assert guard.refusal(method, path, headers, bytes(tampered))[0] == 401
    assert guard.refusal(method, path, headers, body) is None


@pytest.mark.parametrize("mode, content, sentence", [
    (0o640, "s3cret", "--secret-file {path} is readable by group or others; run chmod 600 {path}."),
    (0o604, "s3cret", "--secret-file {path} is readable by group or others; run chmod 600 {path}."),
    (0o600, " \n", "--secret-file {path} is empty; write a long random secret into it (e.g. python -c 'import "
                   "secrets; print(secrets.token_hex(32))')."),
    (None, None, "--secret-file {path} cannot be read (No such file or directory); pass the file serve created or "
                 "wrote its path in its first lines."),
])
def test_a_secret_file_others_can_read_or_without_a_secret_is_refused(tmp_path, mode, content, sentence):
    path = str(tmp_path / "secret")
    if content is not None:
        with open(path, "w") as handle:
            handle.write(content)
        os.chmod(path, mode)
    with pytest.raises(ConfigError) as refused:
        auth.read_secret_file(path)
    assert str(refused.value) == sentence.format(path=path)


def test_a_created_secret_is_the_owners_alone_and_kept(tmp_path):
    path = str(tmp_path / "work" / "secret")
    secret = auth.create_secret_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600 and len(secret) == 64
    assert auth.create_secret_file(path) == secret == auth.configured_secret(path)
    assert os.listdir(tmp_path / "work") == ["secret"]  # no temporary left behind


def test_the_secret_from_the_environment_is_not_passed_on(monkeypatch):
    monkeypatch.setenv(auth.SECRET_ENV, "from-the-environment\n")
    assert auth.configured_secret(None) == b"from-the-environment"
    assert auth.SECRET_ENV not in os.environ  # no job or command started later inherits it
    assert auth.configured_secret(None) is None
