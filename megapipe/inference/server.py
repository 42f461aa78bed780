"""Megatron-LM's text-generation REST interface over ``generate`` and ``score_continuations``.

``PUT /api`` with JSON ``{"prompts": [...], "tokens_to_generate": n, "temperature": t,
"top_k": k, "top_p": p}`` (and optionally ``random_seed``, ``repetition_penalty``,
``stop_token_ids``) answers ``{"text": [...], "tokens": [...]}``: each prompt followed by its
continuation, and the new token ids. ``PUT /loglikelihood`` with ``{"requests": [[context,
continuation], ...]}`` (texts) answers ``{"loglikelihoods": [[logprob, is_greedy], ...]}``.
A bad request gets 400 and one sentence naming the field; the server keeps serving. Another
method than PUT gets 405 with ``Allow: PUT`` and a JSON sentence naming PUT (http.server alone
would answer an HTML 501 page). Each request is logged in one line, a refusal with its reason.

Global rank 0 listens; it checks each request, then broadcasts it to every rank, and all
ranks run it together (the other ranks wait in ``follow``).
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch.distributed as dist

from megapipe.inference.generation import GenerationError, check_request, generate
from megapipe.inference.loading import LoadedModel
from megapipe.inference.sampling import SamplingParams, stop_tokens_or_end_of_text
from megapipe.inference.scoring import check_pairs, score_continuations

# field -> (type(s), check, what a good value is)
FIELDS = {
    "prompts": (list, lambda v: v and all(isinstance(p, str) and p for p in v),
                "a non-empty list of non-empty strings"),
    "tokens_to_generate": (int, lambda v: v >= 1, "an integer of at least 1"),
    "temperature": ((int, float), lambda v: v >= 0, "a number of at least 0 (0 is greedy)"),
    "top_k": (int, lambda v: v >= 0, "an integer of at least 0"),
    "top_p": ((int, float), lambda v: 0 <= v <= 1, "a number within [0, 1]"),
    "random_seed": (int, lambda v: v >= 0, "a non-negative integer"),
    "repetition_penalty": ((int, float), lambda v: v > 0, "a positive number"),
    "stop_token_ids": (list, lambda v: all(isinstance(t, int) for t in v), "a list of token ids"),
}


def parse_generate(body, tokenizer) -> tuple[list, SamplingParams]:
    """Prompts (token ids) and sampling parameters of a ``PUT /api`` body; GenerationError names a bad field."""
    if not isinstance(body, dict):
        raise GenerationError("the request body must be a JSON object with at least \"prompts\".")
    for name, value in body.items():
        if name not in FIELDS:
            raise GenerationError(f"field {name!r} is unknown; use {', '.join(FIELDS)}.")
        kind, ok, what = FIELDS[name]
        if isinstance(value, bool) or not isinstance(value, kind) or not ok(value):
            raise GenerationError(f"field {name!r} is {value!r}; it must be {what}.")
    if "prompts" not in body:
        raise GenerationError("field 'prompts' is missing; give a list of prompt strings.")
    prompts = [tokenizer.tokenize(text) for text in body["prompts"]]
    params = SamplingParams(max_new_tokens=body.get("tokens_to_generate", 64),
                            temperature=float(body.get("temperature", 1.0)), top_k=body.get("top_k", 0),
                            top_p=float(body.get("top_p", 0.0)), seed=body.get("random_seed", 1234),
                            repetition_penalty=float(body.get("repetition_penalty", 1.0)),
                            stop_tokens=stop_tokens_or_end_of_text(body.get("stop_token_ids"), tokenizer))
    return prompts, params


def parse_loglikelihood(body, tokenizer) -> list:
    """(context ids, continuation ids) pairs of a ``PUT /loglikelihood`` body."""
    requests = body.get("requests") if isinstance(body, dict) else None
    if set(body or {}) != {"requests"} or not isinstance(requests, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r) for r in requests):
        raise GenerationError("the body must be {\"requests\": [[context, continuation], ...]} with texts.")
    return [(tokenizer.tokenize(c), tokenizer.tokenize(x)) for c, x in requests]


def run(loaded: LoadedModel, command: tuple):
    """Run one broadcast command on this rank: ("generate", prompts, params) or ("score", pairs)."""
    if command[0] == "generate":
        return generate(loaded.chunks, loaded.ps, loaded.config, command[1], command[2])
    return score_continuations(loaded.chunks, loaded.ps, loaded.config, command[1])


def broadcast(command) -> tuple:
    box = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def follow(loaded: LoadedModel) -> None:
    """Ranks other than 0: run what rank 0 broadcasts until it says stop."""
    while True:
        command = broadcast(None)
        if command[0] == "stop":
            return
        run(loaded, command)


def make_handler(loaded: LoadedModel):
    tokenizer = loaded.tokenizer

    class Handler(BaseHTTPRequestHandler):
        refusal = None  # the reason of the reply being sent, for its log line

        def _reply(self, status: int, payload: dict, headers: tuple = ()) -> None:
            data = json.dumps(payload).encode()
            self.refusal = payload.get("error")
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self):  # noqa: N802 (http.server's name)
            if self.path not in ("/api", "/loglikelihood"):
                return self._reply(404, {"error": f"no endpoint {self.path}; use PUT /api or PUT /loglikelihood."})
            try:
                length = int(self.headers.get("Content-Length", 0))
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except json.JSONDecodeError as error:
                    raise GenerationError(f"the request body is not JSON ({error.msg}).") from None
                if self.path == "/api":
                    prompts, params = parse_generate(body, tokenizer)
                    check_request(prompts, params, loaded.config, "left")
                    command = ("generate", prompts, params)
                else:
                    pairs = parse_loglikelihood(body, tokenizer)
                    check_pairs(pairs, loaded.config)
                    command = ("score", pairs)
            except GenerationError as error:
                return self._reply(400, {"error": str(error)})
            result = run(loaded, broadcast(command))
            if command[0] == "score":
                return self._reply(200, {"loglikelihoods": [list(r) for r in result]})
            texts = [tokenizer.detokenize(p + new) for p, new in zip(prompts, result)]
            return self._reply(200, {"text": texts, "tokens": result})

        def _not_put(self):
            self._reply(405, {"error": f"{self.command} is not served here; send PUT /api (generation) or PUT "
                                       "/loglikelihood (scoring) with a JSON body."}, (("Allow", "PUT"),))

        do_GET = do_POST = do_DELETE = do_PATCH = _not_put  # noqa: N815 (http.server's names)

        def log_request(self, code="-", size="-"):  # one line per request, a refusal with its reason
            reason = f" {self.refusal}" if self.refusal else ""
            self.log_message('"%s" %s %s%s', self.requestline, str(getattr(code, "value", code)), size, reason)

        def log_message(self, fmt, *args):
            print(f"{self.address_string()} {fmt % args}", flush=True)

    return Handler


def serve(loaded: LoadedModel, host: str, port: int, announce=print) -> None:
    """Serve on rank 0 (one request at a time, as every rank runs it); other ranks follow."""
    if dist.get_rank() != 0:
        return follow(loaded)
    server = HTTPServer((host, port), make_handler(loaded))  # one request at a time: all ranks run it together
    announce(f"serving on http://{host}:{server.server_address[1]}/api")
    try:
        server.serve_forever()
    finally:
        broadcast(("stop",))
        server.server_close()
