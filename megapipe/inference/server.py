"""Megatron-LM's text-generation REST interface over ``generate`` and ``score_continuations``, bounded.

``PUT /api`` with JSON ``{"prompts": [...], "tokens_to_generate": n, "temperature": t,
"top_k": k, "top_p": p}`` (and optionally ``random_seed``, ``repetition_penalty``,
``stop_token_ids``) answers ``{"text": [...], "tokens": [...], "cut_at_deadline": false}``: each
prompt followed by its continuation, and the new token ids. ``PUT /loglikelihood`` with
``{"requests": [[context, continuation], ...]}`` (texts) answers ``{"loglikelihoods": [[logprob,
is_greedy], ...]}``. Another method than PUT gets 405 with ``Allow: PUT`` and a JSON sentence naming
PUT (http.server alone would answer an HTML 501 page). Each request is logged in one line, a refusal
with its reason; the server keeps serving after every refusal.

Bounds (``server_limits.py``), all checked on rank 0 before any rank works: the body's size from
its Content-Length (413 above ``--max-request-bytes``, 411 without it, 400 if it is no number), a
body that stops short of it (400, after ``--read-timeout-seconds`` without bytes), a body that is
not UTF-8 JSON holding an object (400), the number of prompts or pairs, their tokens and
``tokens_to_generate`` (400). Connections are served concurrently, but the requests run one at a
time, in arrival order, on every rank (``request_queue.py``): with ``--max-queued-requests``
waiting, another gets 503 with ``Retry-After``. Each request has a deadline
``--request-timeout-seconds`` after its arrival: one still queued then gets 504; a generation
running then stops on every rank alike (``deadline.py``) and answers 200 with the tokens chosen so
far and ``"cut_at_deadline": true``. Scoring is one forward pass bounded by the limits, so its
deadline bounds only its wait in the queue. A failure of the server itself answers 500 with one
sentence (its traceback goes to the log) and the server goes on.

Global rank 0 listens; its main thread takes each request from the queue and broadcasts it, and
all ranks run it together (the other ranks wait in ``follow``, ``commands.py``).
"""

from __future__ import annotations

import threading
import time
import traceback
from http.server import ThreadingHTTPServer

import torch.distributed as dist

from megapipe.errors import first_line
from megapipe.inference.deadline import Deadline
from megapipe.inference.commands import broadcast, follow, lead
from megapipe.inference.generation import GenerationError, check_request
from megapipe.inference.loading import LoadedModel
from megapipe.inference.request_queue import Job, QueueFull, RequestQueue
from megapipe.inference.sampling import SamplingParams, stop_tokens_or_end_of_text
from megapipe.inference.scoring import check_pairs
from megapipe.inference.server_limits import ServerLimits
from megapipe.json_http import JsonHandler, Refusal, json_object

ENDPOINTS = ("/api", "/loglikelihood")
EXAMPLE = '{"prompts": ["Hello"]}'  # a body a refusal shows
SEED_LIMIT = 1 << 32
TOKEN_ID_LIMIT = 1 << 62  # any id a torch long holds; ids outside the vocabulary simply never occur


def _text(value) -> bool:
    """A non-empty string that UTF-8 can carry (JSON's \\ud800 escapes give lone surrogates, which it cannot)."""
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _int_list(v, limit: int) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in v)


# field -> (type(s), check, what a good value is)
FIELDS = {
    "prompts": (list, lambda v: v and all(_text(p) for p in v),
                "a non-empty list of non-empty strings (without lone surrogates)"),
    "tokens_to_generate": (int, lambda v: v >= 1, "an integer of at least 1"),
    "temperature": ((int, float), lambda v: v >= 0, "a number of at least 0 (0 is greedy)"),
    "top_k": (int, lambda v: v >= 0, "an integer of at least 0"),
    "top_p": ((int, float), lambda v: 0 <= v <= 1, "a number within [0, 1]"),
    "random_seed": (int, lambda v: 0 <= v < SEED_LIMIT, "an integer within [0, 2**32)"),
    "repetition_penalty": ((int, float), lambda v: v > 0, "a positive number"),
    "stop_token_ids": (list, lambda v: _int_list(v, TOKEN_ID_LIMIT), "a list of non-negative token ids"),
}


def _shown(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters, so a refusal stays one short sentence."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_generate(body: dict, tokenizer, limits: ServerLimits = ServerLimits()) -> tuple[list, SamplingParams]:
    """Prompts (token ids) and sampling parameters of a ``PUT /api`` body within ``limits``;
    GenerationError names a bad field, Refusal an exceeded limit."""
    for name, value in body.items():
        if name not in FIELDS:
            raise GenerationError(f"field {_shown(name)} is unknown; use {', '.join(FIELDS)}.")
        kind, ok, what = FIELDS[name]
        if isinstance(value, bool) or not isinstance(value, kind) or not ok(value):
            raise GenerationError(f"field {name!r} is {_shown(value)}; it must be {what}.")
    if "prompts" not in body:
        raise GenerationError("field 'prompts' is missing; give a list of prompt strings.")
    limits.check_count(len(body["prompts"]), "prompts")
    prompts = [tokenizer.tokenize(text) for text in body["prompts"]]
    default_tokens = min(64, limits.max_tokens_to_generate)
    params = SamplingParams(max_new_tokens=body.get("tokens_to_generate", default_tokens),
                            temperature=float(body.get("temperature", 1.0)), top_k=body.get("top_k", 0),
                            top_p=float(body.get("top_p", 0.0)), seed=body.get("random_seed", 1234),
                            repetition_penalty=float(body.get("repetition_penalty", 1.0)),
                            stop_tokens=stop_tokens_or_end_of_text(body.get("stop_token_ids"), tokenizer))
    if all(prompts):
        limits.check_prompts(prompts, params.max_new_tokens)
    return prompts, params


def parse_loglikelihood(body: dict, tokenizer, limits: ServerLimits = ServerLimits()) -> list:
    """(context ids, continuation ids) pairs of a ``PUT /loglikelihood`` body within ``limits``."""
    requests = body.get("requests")
    if set(body) != {"requests"} or not isinstance(requests, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(_text(x) for x in r) for r in requests):
        raise GenerationError("the body must be {\"requests\": [[context, continuation], ...]} with non-empty texts.")
    limits.check_count(len(requests), "requests")
    pairs = [(tokenizer.tokenize(c), tokenizer.tokenize(x)) for c, x in requests]
    if pairs:
        limits.check_pairs(pairs)
    return pairs


def command_of(path: str, body: dict, loaded: LoadedModel, limits: ServerLimits) -> tuple:
    """The command every rank runs for a checked request: ("generate", prompts, params) or ("score", pairs)."""
    if path == "/api":
        prompts, params = parse_generate(body, loaded.tokenizer, limits)
        check_request(prompts, params, loaded.config, "left")
        return "generate", prompts, params
    pairs = parse_loglikelihood(body, loaded.tokenizer, limits)
    check_pairs(pairs, loaded.config)
    return "score", pairs


def answer(command: tuple, result, tokenizer) -> dict:
    """The JSON answer of a command that ran."""
    if command[0] == "score":
        return {"loglikelihoods": [list(r) for r in result]}
    tokens, cut = result
    texts = [tokenizer.detokenize(p + new) for p, new in zip(command[1], tokens)]
    return {"text": texts, "tokens": tokens, "cut_at_deadline": cut}


def run_next(loaded: LoadedModel, jobs: RequestQueue) -> None:
    """Rank 0: run the next queued request on every rank and hand its outcome to its connection."""
    job = jobs.next()
    try:
        job.finish(lead(loaded, job.command, Deadline(job.deadline)))
    except Exception as error:  # the connection answers 500 with it; the server goes on
        traceback.print_exc()
        job.finish(error=error)


def work(loaded: LoadedModel, jobs: RequestQueue) -> None:
    """Rank 0's main thread: run the queued requests one at a time, in arrival order, on every rank."""
    while True:
        run_next(loaded, jobs)


def make_handler(loaded: LoadedModel, limits: ServerLimits = ServerLimits(), jobs: RequestQueue = None,
                 clock=time.monotonic):
    class Handler(JsonHandler):
        timeout = limits.read_timeout_seconds
        max_body_bytes = limits.max_request_bytes
        limit_text = f"--max-request-bytes {limits.max_request_bytes}"
        waited_text = f"--read-timeout-seconds {limits.read_timeout_seconds:g}"
        body_required = True

        def do_PUT(self):  # noqa: N802 (http.server's name)
            deadline = clock() + limits.request_timeout_seconds
            try:
                body = self.read_json_body()  # read first, so that the client is not cut off while it still sends
                if self.path not in ENDPOINTS:
                    raise Refusal(404, f"no endpoint {_shown(self.path)}; use PUT /api or PUT /loglikelihood.")
                command = command_of(self.path, json_object(body, EXAMPLE), loaded, limits)
                job = jobs.submit(Job(command, deadline))
            except Refusal as refusal:
                return self.send_refusal(refusal)
            except GenerationError as error:
                return self.send_json(400, {"error": str(error)})
            except QueueFull:
                return self.send_json(503, {"error": f"the server is busy: --max-queued-requests "
                                                     f"{limits.max_queued_requests} requests already wait; retry "
                                                     "later."}, (("Retry-After", "1"),))
            except Exception as error:  # a bug, answered rather than a dropped connection; the server goes on
                traceback.print_exc()
                return self.send_json(500, {"error": f"the server failed on this request ({first_line(error)})."})
            if not job.wait(clock):
                return self.send_json(504, {"error": f"the request waited in the queue past its deadline "
                                                     f"(--request-timeout-seconds {limits.request_timeout_seconds}); "
                                                     "retry later."})
            if job.error is not None:
                return self.send_json(500, {"error": f"the server failed on this request "
                                                     f"({first_line(job.error)})."})
            return self.send_json(200, answer(command, job.result, loaded.tokenizer))

        def refuse_method(self) -> None:
            if self.headers.get("Content-Length") is not None:
                try:  # read a body within the limits, so that the client is not cut off while it still sends
                    self.read_json_body()
                except Refusal:
                    pass
            self.send_json(405, {"error": f"{self.command[:40]} is not served here; send PUT /api (generation) or "
                                          "PUT /loglikelihood (scoring) with a JSON body."}, (("Allow", "PUT"),))

        do_GET = do_POST = do_DELETE = do_PATCH = refuse_method  # noqa: N815 (http.server's names)

        def malformed(self, code: int, message) -> str:
            return (f"the request is malformed ({message or code}); send PUT /api or PUT /loglikelihood with a "
                    "JSON body.")

    return Handler


def serve(loaded: LoadedModel, host: str, port: int, limits: ServerLimits = ServerLimits(), announce=print) -> None:
    """Serve on rank 0 (connections concurrently, requests one at a time on every rank); other ranks follow."""
    if dist.get_rank() != 0:
        return follow(loaded)
    jobs = RequestQueue(limits.max_queued_requests)
    server = ThreadingHTTPServer((host, port), make_handler(loaded, limits, jobs))
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    announce(f"serving on http://{host}:{server.server_address[1]}/api")
    try:
        work(loaded, jobs)
    finally:
        server.shutdown()
        broadcast(("stop",))
        server.server_close()
