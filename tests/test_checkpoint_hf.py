"""Hugging Face round trip: transformers GPT-2 and BERT (built from a config, no download) ->
save_pretrained -> megapipe checkpoint -> logits at t=2 and at p=2 -> export -> from_pretrained.

GPT-2 is saved as safetensors, BERT as ``pytorch_model.bin``, so both import paths run.
Logits agree to 1e-5 relative (see test_hf_equivalence: the same fp32 maths in another
order); the exported weights are the imported ones bit for bit, so transformers computes
exactly its original logits again.
"""

import os

import pytest
import torch
import torch.distributed as dist
import transformers

from checkpoint_helpers import convert_tool
from megapipe.checkpointing.load import load_weights
from megapipe.checkpointing.common import Common, SavedLayout
from megapipe.checkpointing.convert import export_hf_checkpoint, import_hf_checkpoint
from megapipe.checkpointing.paths import find_checkpoint
from megapipe.errors import CheckpointError
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

RTOL = 1e-5
BATCH, SEQ = 3, 12


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


def _perturbed(model):
    """Non-trivial norms and biases, so a swapped mapping shows up."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _hf_models(root):
    torch.manual_seed(0)
    gpt = _perturbed(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=SEQ)))
    gpt.save_pretrained(os.path.join(root, "gpt2"))
    bert = _perturbed(transformers.BertForPreTraining(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=93,
        max_position_embeddings=SEQ)))
    bert.config.save_pretrained(os.path.join(root, "bert"))
    torch.save(bert.state_dict(), os.path.join(root, "bert", "pytorch_model.bin"))
    return {"gpt": gpt, "bert": bert}


def _inputs(kind, vocab):
    g = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, vocab, (BATCH, SEQ), generator=g)}
    if kind == "bert":
        padding = torch.ones(BATCH, SEQ, dtype=torch.long)
        padding[1, 7:] = 0
        batch.update(types=torch.randint(0, 2, (BATCH, SEQ), generator=g), padding_mask=padding)
    return batch


def _hf_logits(kind, model, batch):
    with torch.no_grad():
        if kind == "gpt":
            return model(batch["tokens"]).logits
        return model(input_ids=batch["tokens"], token_type_ids=batch["types"],
                     attention_mask=batch["padding_mask"]).prediction_logits


def _megapipe_logits(rank, world_size, checkpoints, batches):
    """Logits of each imported model at (t, p) = (2, 1) and (1, 2), on the rank that has them."""
    out = {}
    for t, p in ((2, 1), (1, 2)):
        ps = ParallelState.initialize(t, p)
        for kind, directory in checkpoints.items():
            config = Common.read(find_checkpoint(directory)).model_config
            chunk = build_model_chunks(kind, config, ps)[0].eval()
            load_weights(directory, kind, [chunk], ps, config)
            with torch.no_grad():
                hidden = None
                if not ps.is_first_stage:
                    hidden = torch.empty(SEQ, BATCH, config.hidden_size)
                    dist.recv(hidden, ps.prev_rank)
                result = chunk(hidden, batches[kind])
                if not ps.is_last_stage:
                    dist.send(result, ps.next_rank)
                    continue
            logits = result if kind == "gpt" else result[0]
            logits = _gather_vocab(logits, ps) if ps.tp_size > 1 else logits
            if ps.tp_rank == 0:
                out[(kind, t, p)] = logits[..., : config.vocab_size]
    return out


def _gather_vocab(logits, ps):
    """The whole vocabulary's logits from each tensor rank's slice."""
    parts = [torch.empty_like(logits) for _ in range(ps.tp_size)]
    dist.all_gather(parts, logits.contiguous(), group=ps.tp_group)
    return torch.cat(parts, dim=-1)


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf"))
    models = _hf_models(root)
    checkpoints, batches, conversions = {}, {}, {}
    for kind, name in (("gpt", "gpt2"), ("bert", "bert")):
        checkpoints[kind] = os.path.join(root, f"{kind}-megapipe")
        conversions[kind] = import_hf_checkpoint(os.path.join(root, name), checkpoints[kind], SavedLayout(2, 1, 1))
        batches[kind] = _inputs(kind, models[kind].config.vocab_size)
    logits = {}
    for rank_logits in run_distributed(2, _megapipe_logits, checkpoints, batches, timeout=300):
        logits.update(rank_logits)
    exported = {}
    for kind in checkpoints:
        target = os.path.join(root, f"{kind}-exported")
        export_hf_checkpoint(checkpoints[kind], target)
        exported[kind] = type(models[kind]).from_pretrained(target).eval()
    return models, batches, logits, exported, conversions


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["gpt", "bert"])
@pytest.mark.parametrize("t, p", [(2, 1), (1, 2)])
def test_imported_model_gives_transformers_logits(round_trip, kind, t, p):
    models, batches, logits, _, conversions = round_trip
    expected = _hf_logits(kind, models[kind], batches[kind])
    actual = logits[(kind, t, p)]
    if kind == "bert":  # padded query positions are garbage on both sides
        real = batches[kind]["padding_mask"].bool()
        actual, expected = actual[real], expected[real]
    assert_close(actual, expected)
    assert conversions[kind].source_layout is None and conversions[kind].target_layout == SavedLayout(2, 1, 1)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_exported_checkpoint_loads_in_transformers_unchanged(round_trip, kind):
    models, batches, _, exported, _ = round_trip
    original, back = models[kind].state_dict(), exported[kind].state_dict()
    assert set(back) == set(original)
    for key, value in original.items():
        assert torch.equal(back[key], value), key
    assert torch.equal(_hf_logits(kind, exported[kind], batches[kind]), _hf_logits(kind, models[kind], batches[kind]))


@pytest.mark.unit
def test_unsupported_architecture_is_one_sentence(tmp_path):
    config = transformers.GPTNeoXConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                        intermediate_size=32, vocab_size=50)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox")
    with pytest.raises(CheckpointError, match=r"holds a 'gpt_neox' model \(GPTNeoXForCausalLM\), which cannot be"):
        import_hf_checkpoint(str(tmp_path / "neox"), str(tmp_path / "out"), SavedLayout(1, 1, 1))
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_convert_tool_prints_what_it_did_and_errors_in_one_line(round_trip, tmp_path, capsys):
    tool = convert_tool()
    source = str(tmp_path / "missing")
    assert tool.main(["reshard", source, str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: checkpoint directory")
    models = round_trip[0]
    models["gpt"].save_pretrained(tmp_path / "gpt2")
    assert tool.main(["import-hf", str(tmp_path / "gpt2"), str(tmp_path / "ckpt"),
                      "--pipeline-model-parallel-size", "2"]) == 0
    assert tool.main(["reshard", str(tmp_path / "ckpt"), str(tmp_path / "t2"),
                      "--tensor-model-parallel-size", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-4] == f"source:  {tmp_path / 'ckpt' / 'iter_0000000'} ((t, p, d) = (1, 2, 1))"
    assert printed[-3] == f"target:  {tmp_path / 't2' / 'iter_0000000'} ((t, p, d) = (2, 1, 1))"
    assert printed[-2] == f"tensors: {len(models['gpt'].state_dict()) - 1}"  # lm_head is the tied embedding
    assert printed[-1].startswith("bytes:   ")
    assert sorted(os.listdir(tmp_path / "t2" / "iter_0000000")) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                     "common.json"]
