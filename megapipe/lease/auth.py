"""Signed requests between the scheduler service, its agents, its clients and its jobs' leases.

One shared secret (a file only its owner may read, or ``MEGAPIPE_CLUSTER_SECRET``) signs every
request: HMAC-SHA256 over the method, the path (with its query), a timestamp, a random nonce and
the body's SHA-256, sent in three headers. The service accepts a timestamp within
``WINDOW_SECONDS`` of its clock and each nonce once (``ReplayGuard``), so a captured request
cannot be sent again. Keys derived from the secret narrow what a holder may do: a job gets the
key of its own lease (``lease_key``, only ``POST /leases/<job>/<lease>``), a browser the status
page's read-only token (``page_token``, only ``GET /`` and ``GET /status``, as ``?token=``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from typing import Optional
from urllib.parse import parse_qs, urlsplit

from megapipe.atomic_files import write_atomically
from megapipe.errors import ConfigError

SECRET_ENV = "MEGAPIPE_CLUSTER_SECRET"  # the secret itself, for whoever cannot keep a file
LEASE_KEY_ENV = "MEGAPIPE_CLUSTER_LEASE_KEY"  # a launched job's key for its lease's route only
TIMESTAMP, NONCE, SIGNATURE = "X-Megapipe-Timestamp", "X-Megapipe-Nonce", "X-Megapipe-Signature"
WINDOW_SECONDS = 60.0  # how far a request's timestamp may be from the service's clock (hosts run NTP)
MAX_NONCES = 100_000  # nonces remembered at most (about 10 MB); more signed requests per window are refused
READ_ONLY_ROUTES = ("/", "/status")
_NONCE = re.compile(r"[0-9a-f]{16,64}")
_HEX_MAC = re.compile(r"[0-9a-f]{64}")


def read_secret_file(path: str) -> bytes:
    """The secret in ``path``; ConfigError if it is missing, empty, or readable by anyone but its owner."""
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as handle:
            secret = handle.read().strip()
    except OSError as error:
        raise ConfigError(f"--secret-file {path} cannot be read ({error.strerror}); pass the file serve created "
                          "or wrote its path in its first lines.")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"--secret-file {path} is readable by group or others; run chmod 600 {path}.")
    if not secret:
        raise ConfigError(f"--secret-file {path} is empty; write a long random secret into it "
                          "(e.g. python -c 'import secrets; print(secrets.token_hex(32))').")
    return secret


def configured_secret(secret_file: Optional[str]) -> Optional[bytes]:
    """The secret of ``--secret-file``, else of ``MEGAPIPE_CLUSTER_SECRET``, else None. The variable is
    taken out of this process's environment, so that no job or command it starts inherits the secret."""
    from_environment = os.environ.pop(SECRET_ENV, "").strip().encode()
    if secret_file:
        return read_secret_file(secret_file)
    return from_environment or None


def create_secret_file(path: str) -> bytes:
    """A new random secret in ``path`` (mode 0600, written atomically); an existing one is kept and returned."""
    if os.path.exists(path):
        return read_secret_file(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomically(path, secrets.token_hex(32) + "\n", mode=0o600)
    return read_secret_file(path)


def _derive(secret: bytes, purpose: str) -> bytes:
    return hmac.new(secret, purpose.encode(), hashlib.sha256).hexdigest().encode()


def lease_key(secret: bytes, job_id: int, lease: int) -> bytes:
    """The key that signs job ``job_id``'s reports under lease ``lease``, and nothing else."""
    return _derive(secret, f"lease/{job_id}/{lease}")


def page_token(secret: bytes) -> str:
    """The status page's read-only token (``?token=``): GET of / and /status only."""
    return _derive(secret, "status-page").decode()


def _mac(key: bytes, method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    message = "\n".join((method, path, timestamp, nonce, hashlib.sha256(body).hexdigest())).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, url: str, body: bytes = b"") -> dict:
    """The headers that authorise one request of ``method`` to ``url`` (its path and query) with ``body``."""
    parts = urlsplit(url)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    timestamp, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    return {TIMESTAMP: timestamp, NONCE: nonce, SIGNATURE: _mac(key, method, path, timestamp, nonce, body)}


class ReplayGuard:
    """Checks signed requests; each nonce is accepted once while its timestamp could still pass."""

    def __init__(self, secret: bytes, window: float = WINDOW_SECONDS, capacity: int = MAX_NONCES):
        self.secret, self.window, self.capacity = secret, window, capacity
        self.seen: OrderedDict = OrderedDict()  # nonce -> when it may be forgotten, in arrival order
        self.lock = threading.Lock()

    def refusal(self, method: str, path: str, headers, body: bytes) -> Optional[tuple[int, str]]:
        """None when the request may proceed, else (HTTP status, one sentence saying why not)."""
        route = urlsplit(path).path
        if method == "GET" and route in READ_ONLY_ROUTES and SIGNATURE not in headers:
            token = parse_qs(urlsplit(path).query).get("token", [""])[0]
            if hmac.compare_digest(token.encode(), page_token(self.secret).encode()):
                return None
            return 401, (f"GET {route} needs the status page's token; open the address serve printed "
                         "(http://HOST:PORT/?token=...) or run tools/cluster.py status --page-url.")
        timestamp, nonce, signature = (headers.get(name) or "" for name in (TIMESTAMP, NONCE, SIGNATURE))
        if not (timestamp and nonce and signature):
            return 401, (f"{method} {route} needs a signed request ({TIMESTAMP}, {NONCE}, {SIGNATURE}); pass "
                         f"--secret-file to tools/cluster.py or set {SECRET_ENV}.")
        try:
            skew = abs(time.time() - float(timestamp))
        except ValueError:
            skew = float("inf")
        if not skew <= self.window:
            return 401, (f"the request's {TIMESTAMP} is not within {self.window:g} s of the scheduler's clock; "
                         "synchronise the hosts' clocks (NTP) and sign each request when it is sent.")
        keys = [self.secret]
        if lease := re.fullmatch(r"/leases/(\d+)/(\d+)", route):
            keys.append(lease_key(self.secret, int(lease[1]), int(lease[2])))
        if not (_NONCE.fullmatch(nonce) and _HEX_MAC.fullmatch(signature)) or not any(
                hmac.compare_digest(signature, _mac(key, method, path, timestamp, nonce, body)) for key in keys):
            return 401, ("the request's signature does not match; sign it with the scheduler's secret "
                         "(--secret-file, the same file serve uses).")
        return self._remember(nonce)

    def _remember(self, nonce: str) -> Optional[tuple[int, str]]:
        now = time.monotonic()
        with self.lock:
            while self.seen and next(iter(self.seen.values())) < now:
                self.seen.popitem(last=False)
            if nonce in self.seen:
                return 401, "the request was already received once (a replay); sign every request anew."
            if len(self.seen) >= self.capacity:
                return 429, (f"the scheduler received more than {self.capacity} signed requests in "
                             f"{2 * self.window:g} s; send fewer and retry in a minute.")
            self.seen[nonce] = now + 2 * self.window  # a timestamp up to `window` ahead stays valid that long
            return None
