"""The bounds of the text-generation server: how much one request may ask, how many may wait, how long.

Every bound is checked on rank 0 before the request is broadcast, so no rank works on a request
that is refused. Each refusal is one sentence naming the limit and the flag that sets it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megapipe.json_http import Refusal


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 1 << 20
    max_prompts: int = 64
    max_prompt_tokens: int = 4096
    max_tokens_to_generate: int = 1024
    max_queued_requests: int = 16
    request_timeout_seconds: float = 300.0
    read_timeout_seconds: float = 10.0

    @staticmethod
    def from_args(args: argparse.Namespace) -> "ServerLimits":
        return ServerLimits(**{name: getattr(args, name) for name in ServerLimits.__dataclass_fields__})

    def check_prompts(self, prompts: list, tokens_to_generate: int) -> None:
        """A generation request (prompts as token ids) within --max-prompts, --max-prompt-tokens and
        --max-tokens-to-generate."""
        self.check_count(len(prompts), "prompts")
        self.check_tokens(max(len(p) for p in prompts), "a prompt")
        if tokens_to_generate > self.max_tokens_to_generate:
            raise Refusal(400, f"tokens_to_generate {tokens_to_generate} exceeds --max-tokens-to-generate "
                               f"{self.max_tokens_to_generate}; ask for fewer tokens.")

    def check_pairs(self, pairs: list) -> None:
        """A scoring request within --max-prompts pairs of at most --max-prompt-tokens tokens each."""
        self.check_count(len(pairs), "requests")
        self.check_tokens(max(len(c) + len(x) for c, x in pairs), "a context and continuation")

    def check_count(self, count: int, what: str) -> None:
        if count > self.max_prompts:
            raise Refusal(400, f"{count} {what} exceed --max-prompts {self.max_prompts}; send at most "
                               f"{self.max_prompts} per request.")

    def check_tokens(self, tokens: int, what: str) -> None:
        if tokens > self.max_prompt_tokens:
            raise Refusal(400, f"{what} of {tokens} tokens exceeds --max-prompt-tokens {self.max_prompt_tokens}; "
                               "shorten it.")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive finite {kind.__name__}")
        return value
    return parse


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """The server's bounds as flags (defaults from ``ServerLimits``)."""
    d = ServerLimits()
    group = parser.add_argument_group("limits", "every request is checked against these before any rank works on it")
    group.add_argument("--max-request-bytes", type=_positive(int), default=d.max_request_bytes,
                       help="largest request body (413 above it; decided from Content-Length) (default %(default)s)")
    group.add_argument("--max-prompts", type=_positive(int), default=d.max_prompts,
                       help="most prompts of a PUT /api, or pairs of a PUT /loglikelihood (default %(default)s)")
    group.add_argument("--max-prompt-tokens", type=_positive(int), default=d.max_prompt_tokens,
                       help="most tokens of one prompt, or of one context and continuation (default %(default)s)")
    group.add_argument("--max-tokens-to-generate", type=_positive(int), default=d.max_tokens_to_generate,
                       help="largest tokens_to_generate (default %(default)s)")
    group.add_argument("--max-queued-requests", type=_positive(int), default=d.max_queued_requests,
                       help="requests that may wait while one runs; more get 503 with Retry-After "
                            "(default %(default)s)")
    group.add_argument("--request-timeout-seconds", type=_positive(float), default=d.request_timeout_seconds,
                       help="a request's deadline from its arrival: still queued then, it gets 504; a generation "
                            "running then stops and answers what it has with \"cut_at_deadline\": true "
                            "(default %(default)s)")
    group.add_argument("--read-timeout-seconds", type=_positive(float), default=d.read_timeout_seconds,
                       help="longest wait for a client's next bytes; a body that stops short gets 400 "
                            "(default %(default)s)")
