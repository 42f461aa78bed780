"""A tiny Llama (or Mixtral) served by ``tools/run_text_generation_server.py`` for the server's system tests.

The model (random weights, a word-level tokenizer.json) is made with transformers and imported from
its Hugging Face directory; the server runs in its own process (or torchrun's) on a free port, its
log drained by a thread (a full pipe would stop it), and is killed when the ``with`` block ends.
"""

import contextlib
import json
import os
import subprocess
import sys
import threading

import torch
import transformers

from megapipe.checkpointing.common import SavedLayout
from megapipe.checkpointing.convert import import_hf_checkpoint
from launch_helpers import REPO as ROOT, kill_tree, standalone

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "and", "then", "slept", "here", "now",
         "big", "red", "sun", "rose", "over", "hills"]


def _tokenizer_json() -> str:
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
                       "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
                       "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(WORDS)},
                                 "unk_token": "the"}})


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=len(WORDS), max_position_embeddings=64,
        initializer_range=0.3))  # logits far apart, so no near-tie decides a greedy token


def _mixtral():
    """A Mixtral of 4 experts, top-2, whose routers are scaled up so no near-tie decides a route."""
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=len(WORDS), max_position_embeddings=64,
        initializer_range=0.3, eos_token_id=None, bos_token_id=None))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(10.0)
    return model


ARCHITECTURES = {"llama": _llama, "mixtral": _mixtral}


def tiny_checkpoint(root, architecture: str = "llama"):
    """The transformers model of ``architecture`` and the megapipe checkpoint imported from it, under ``root``."""
    torch.manual_seed(0)
    model = ARCHITECTURES[architecture]().eval()
    model.save_pretrained(root / "hf")
    (root / "hf" / "tokenizer.json").write_text(_tokenizer_json())
    import_hf_checkpoint(str(root / "hf"), str(root / "ckpt"), SavedLayout(1, 1, 1))
    return model, str(root / "ckpt")


def server_env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")


@contextlib.contextmanager
def serving(checkpoint: str, *flags: str, nproc: int = 1):
    """(URL of ``PUT /api``, its log lines so far) of a server of ``checkpoint`` started with ``flags``, on one
    process or on ``nproc`` under torchrun (killed with its workers at the end)."""
    command = [os.path.join(ROOT, "tools", "run_text_generation_server.py"), "--load", checkpoint, "--port", "0",
               *flags]
    command = [sys.executable, *command] if nproc == 1 else standalone(nproc, command)
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=server_env(), start_new_session=True)
    try:
        line = server.stdout.readline()  # blocks until the server announces itself (or exits)
        assert line.startswith("serving on http://"), line
        log = []
        threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
        yield line.split()[-1], log
    finally:
        kill_tree(server.pid)
        server.wait(timeout=30)
