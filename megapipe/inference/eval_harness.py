"""A megapipe model as an lm-evaluation-harness (``lm_eval``) LM, at any tensor x pipeline layout.

Rank 0 runs lm_eval; each batch of its requests becomes one command (``commands.py``) that every
rank runs, while the other ranks ``follow``. Texts are read with the checkpoint's tokenizer, as
lm_eval's Hugging Face model reads them: a continuation's tokens are those the whole text has
beyond its context's (spaces ending a context move to the continuation), an empty context is the
end-of-text token, inputs longer than the model keep their last tokens, and a rolling
log-likelihood sums disjoint windows that fill ``--max-position-embeddings``. Generation is greedy
unless a task asks to sample, stops at end-of-text and ``max_gen_toks``, and is cut at the first
``until`` string. lm_eval is optional, so the LM class is made when first asked for.
"""

from __future__ import annotations

import functools
from megapipe.errors import ConfigError
from megapipe.inference.commands import lead
from megapipe.inference.loading import LoadedModel
from megapipe.inference.sampling import SamplingParams
from megapipe.optional import require

MAX_GEN_TOKS = 256  # lm_eval's default for a task that names none


class Requests:
    """Token-level answers to lm_eval's three kinds of request, in batches of ``batch_size`` commands."""

    def __init__(self, loaded: LoadedModel, batch_size: int):
        self.loaded, self.batch_size = loaded, batch_size
        self.tokenizer = loaded.tokenizer
        self.max_length = loaded.config.max_position_embeddings

    def end_of_text(self) -> int:
        eod = self.tokenizer.special_id("eod")
        if eod is None:
            raise ConfigError("an empty context and a rolling log-likelihood start from the end-of-text token, and "
                              "this checkpoint's tokenizer has none; evaluate tasks whose contexts are not empty.")
        return eod

    def pair(self, context: str, continuation: str) -> tuple[list, list]:
        """(context ids, continuation ids) of two texts, as lm_eval's Hugging Face model tokenises them."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.end_of_text()], self.tokenizer.tokenize(continuation)
        whole = self.tokenizer.tokenize(context + continuation)
        ids = self.tokenizer.tokenize(context)
        if len(whole) <= len(ids):  # the context's last token swallowed the continuation: keep them apart
            return ids, self.tokenizer.tokenize(continuation)
        return whole[:len(ids)], whole[len(ids):]

    def fit(self, context: list, continuation: list) -> tuple[list, list]:
        """The pair cut to its last ``max_length`` tokens (a continuation keeps at least one token before it)."""
        window = (context + continuation)[-self.max_length:]
        split = len(window) - min(len(continuation), self.max_length - 1)
        return window[:split], window[split:]

    def scores(self, pairs: list) -> list:
        """[(log-likelihood, is_greedy)] of token pairs, longest first in each batch, in the given order."""
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        out = [None] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            for row, result in zip(rows, lead(self.loaded, ("score", [pairs[i] for i in rows]))):
                out[row] = (float(result[0]), bool(result[1]))
        return out

    def loglikelihood(self, texts: list) -> list:
        return self.scores([self.fit(*self.pair(context, continuation)) for context, continuation in texts])

    def rolling_windows(self, text: str) -> list:
        """Disjoint (context, continuation) windows of ``max_length`` tokens covering every token of ``text``."""
        utils = require("lm_eval.utils", "evaluation", "lm-eval")
        windows = utils.get_rolling_token_windows(token_list=self.tokenizer.tokenize(text),
                                                  prefix_token=self.end_of_text(),
                                                  max_seq_len=self.max_length - 1, context_len=1)
        return [utils.make_disjoint_window(window) for window in windows]

    def loglikelihood_rolling(self, texts: list) -> list:
        windows = [self.rolling_windows(text) for text in texts]
        scores = iter(self.scores([w for text_windows in windows for w in text_windows]))
        return [sum(next(scores)[0] for _ in text_windows) for text_windows in windows]

    def params(self, kwargs: dict) -> tuple[SamplingParams, list]:
        """Sampling parameters and stop strings of one request's generation arguments."""
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
        eod = self.tokenizer.special_id("eod")
        return SamplingParams(max_new_tokens=int(kwargs.get("max_gen_toks", MAX_GEN_TOKS)), temperature=temperature,
                              top_p=float(kwargs.get("top_p") or 0.0),
                              stop_tokens=() if eod is None else (eod,)), until

    def generate_until(self, requests: list) -> list:
        """Continuations of (context, generation arguments) requests, batched by equal arguments."""
        groups: dict = {}
        for row, (context, kwargs) in enumerate(requests):
            params, until = self.params(kwargs)
            groups.setdefault((params, tuple(until)), []).append(row)
        out = [None] * len(requests)
        for (params, until), rows in groups.items():
            budget = self.max_length - params.max_new_tokens
            if budget < 1:
                raise ConfigError(f"a task asks for {params.max_new_tokens} new tokens, and the model holds "
                                  f"{self.max_length} positions; set the task's max_gen_toks lower.")
            for start in range(0, len(rows), self.batch_size):
                batch = rows[start:start + self.batch_size]
                prompts = [(self.tokenizer.tokenize(requests[i][0]) or [self.end_of_text()])[-budget:] for i in batch]
                tokens, _ = lead(self.loaded, ("generate", prompts, params))
                for i, new in zip(batch, tokens):
                    out[i] = cut_at(self.tokenizer.detokenize(new), until)
        return out


def cut_at(text: str, until) -> str:
    """``text`` up to the first occurrence of any stop string."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text


@functools.cache
def lm_class():
    """The lm_eval LM subclass (registered as ``megapipe``), made at first use since lm_eval is optional."""
    api = require("lm_eval.api.model", "evaluation", "lm-eval")
    registry = require("lm_eval.api.registry", "evaluation", "lm-eval")

    class MegapipeLM(api.LM):
        """lm_eval's LM over a loaded megapipe model; rank 0 calls it, the other ranks ``follow``."""

        def __init__(self, loaded: LoadedModel, batch_size: int = 16):
            super().__init__()
            self.requests = Requests(loaded, batch_size)

        def _answer(self, kind: str, requests: list, answers: list) -> list:
            for request, answer in zip(requests, answers):
                self.cache_hook.add_partial(kind, request.args, answer)
            return answers

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list:
            return self._answer("loglikelihood", requests,
                                self.requests.loglikelihood([r.args for r in requests]))

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list:
            return self._answer("loglikelihood_rolling", requests,
                                self.requests.loglikelihood_rolling([r.args[0] for r in requests]))

        def generate_until(self, requests, disable_tqdm: bool = False) -> list:
            return self._answer("generate_until", requests,
                                self.requests.generate_until([r.args for r in requests]))

    return registry.register_model("megapipe")(MegapipeLM)

