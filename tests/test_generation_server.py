"""The text-generation server and CLI as users run them: a real process, a real HTTP client.

A tiny Llama (random weights, a word-level tokenizer.json) is imported from a Hugging Face
directory; ``tools/run_text_generation_server.py`` serves it on a free port. Greedy answers
equal transformers' ``generate``; a bad field gets 400 with one sentence and the server keeps
answering; ``tools/generate.py`` prints the same greedy continuation.
"""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from server_helpers import ROOT, WORDS, server_env, serving, tiny_checkpoint

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model, checkpoint = tiny_checkpoint(tmp_path_factory.mktemp("server"))
    with serving(checkpoint) as (url, _):
        yield model, url, checkpoint, server_env()


def _put(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _expected(model, text, n):
    ids = [WORDS.index(w) for w in text.split()]
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_server_answers_like_transformers_and_survives_bad_requests(served):
    model, url, _, _ = served
    prompts = ["the cat sat", "a dog ran far away and"]
    status, answer = _put(url, {"prompts": prompts, "tokens_to_generate": 6, "temperature": 1.0, "top_k": 1,
                                "top_p": 0.0})
    assert status == 200
    assert answer["tokens"] == [_expected(model, p, 6) for p in prompts]
    assert answer["text"][0].startswith("the cat sat ")
    status, answer = _put(url, {"prompts": prompts, "tokens_to_generate": "six"})
    assert status == 400 and answer == {"error": "field 'tokens_to_generate' is 'six'; it must be an integer of at "
                                                 "least 1."}
    status, answer = _put(url, {"prompts": ["the"], "tokens_to_generate": 64})
    assert status == 400 and answer["error"].endswith("exceeds --max-position-embeddings 64; generate at most 63 "
                                                      "tokens.")
    status, answer = _put(url, {"prompts": ["the"], "top_k": 1, "max_tokens": 3})
    assert status == 400 and answer["error"].startswith("field 'max_tokens' is unknown; use prompts, ")
    status, answer = _put(url, {"prompts": ["a dog"], "tokens_to_generate": 3, "top_k": 1})  # still serving
    assert status == 200 and answer["tokens"] == [_expected(model, "a dog", 3)]
    status, answer = _put(url.replace("/api", "/loglikelihood"), {"requests": [["the cat", "sat on"]]})
    with torch.no_grad():
        logprobs = model(torch.tensor([[0, 1, 2, 3]])).logits[0].log_softmax(-1)
    assert status == 200
    assert answer["loglikelihoods"][0][0] == pytest.approx(float(logprobs[1, 2] + logprobs[2, 3]), rel=1e-5)


def test_generate_tool_prints_the_greedy_continuation(served):
    model, _, checkpoint, env = served
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate.py"), "--load", checkpoint,
                           "--prompt", "the cat sat", "--max-new-tokens", "5", "--greedy"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = " ".join(WORDS[i] for i in [0, 1, 2] + _expected(model, "the cat sat", 5))
    assert done.stdout.strip() == expected
