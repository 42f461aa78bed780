"""Continue pretraining an imported Hugging Face Llama with pretrain_gpt.py, then take it back.

A random LlamaForCausalLM (vocabulary of the byte-level tokenizer of the embedded corpus) is
imported at (t, p) = (2, 2), trained for 3 iterations by ``torchrun pretrain_gpt.py --load
--finetune`` under PipeDream-2BW on 4 processes with the Llama flags, exported, and loaded by
transformers: its logits equal those of the trained checkpoint in megapipe (1e-5 of their
scale, fp32 in another order), and training moved the weights.
"""

import os

import pytest
import torch
import transformers
from test_training_cli import run

from megapipe.checkpointing.load import load_weights
from megapipe.checkpointing.common import Common, SavedLayout
from megapipe.checkpointing.convert import export_hf_checkpoint, import_hf_checkpoint
from megapipe.checkpointing.paths import find_checkpoint
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.distributed

LLAMA_FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
               "--num-query-groups", "2", "--ffn-hidden-size", "64", "--swiglu", "--position-embedding-type", "rope",
               "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--seq-length", "32", "--max-position-embeddings", "32"]


def _megapipe_logits(rank, world_size, checkpoint, tokens):
    config = Common.read(find_checkpoint(checkpoint)).model_config
    ps = ParallelState.single()
    ours = build_model_chunks("gpt", config, ps)[0].eval()
    load_weights(checkpoint, "gpt", [ours], ps, config)
    with torch.no_grad():
        return ours(None, {"tokens": tokens})[..., :261]


def test_continue_pretraining_an_imported_llama_and_export_it(tmp_path):
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=261, max_position_embeddings=32, tie_word_embeddings=False)).eval()
    original.save_pretrained(tmp_path / "hf")
    import_hf_checkpoint(str(tmp_path / "hf"), str(tmp_path / "imported"), SavedLayout(2, 2, 1))
    trained = tmp_path / "trained"
    result = run(LLAMA_FLAGS + ["--load", str(tmp_path / "imported"), "--finetune", "--save", str(trained),
                                "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--pipeline-schedule", "2bw", "--train-iters", "3", "--micro-batch-size", "2",
                                "--global-batch-size", "8", "--eval-iters", "1", "--eval-interval", "100",
                                "--log-interval", "1",
                                "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "0"],
                 nproc=4, cache=tmp_path)
    assert result.returncode == 0, result.stderr
    assert " iteration 3/3 " in result.stdout

    export_hf_checkpoint(str(trained), str(tmp_path / "exported"))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert back.config.num_key_value_heads == 2 and back.config.rms_norm_eps == 1e-6
    assert set(back.state_dict()) == set(original.state_dict())
    assert not torch.equal(back.state_dict()["model.layers.0.mlp.gate_proj.weight"],
                           original.state_dict()["model.layers.0.mlp.gate_proj.weight"])

    tokens = torch.randint(0, 261, (2, 20), generator=torch.Generator().manual_seed(3))
    actual = run_distributed(1, _megapipe_logits, str(trained), tokens, timeout=120)[0]
    with torch.no_grad():
        expected = back(tokens).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert os.path.isfile(tmp_path / "exported" / "config.json")
