"""Llama-family models against Hugging Face ``transformers`` (random weights from configs, no download).

One world of 4 ranks checks, at (t, p) = (1, 1), (2, 1), (1, 2), (2, 2):
- logits of imported LlamaForCausalLM (GQA, untied, sharded safetensors), MistralForCausalLM and
  Qwen2ForCausalLM (q/k/v bias, tied) equal transformers' within 1e-5 of the logits' scale
  (same fp32 maths in another order: fused QKV, [s, b, h]; ~1e-7 apart in practice);
- greedy generation of 32 new tokens for prompts of different lengths, left and right padded,
  equals transformers' ``generate`` token for token, pipelined and naive decode alike;
- sampling with a fixed seed gives the same tokens on every layout;
- log-likelihoods of (context, continuation) pairs equal transformers' within 1e-5 relative;
- a deadline that the first stage's first tensor rank alone sees pass stops every rank of the
  layout alike, each row keeping the greedy tokens chosen before it.
Single-process checks: a KV-cache decode equals recomputing without a cache, a deadline cuts every
row at the same round, export is bit-exact, the FLOP formula counts SwiGLU and GQA, and bad input
is one sentence.
"""

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.utils.flop_counter import FlopCounterMode

from megapipe.checkpointing.load import load_weights
from megapipe.checkpointing.common import Common, SavedLayout
from megapipe.checkpointing.convert import export_hf_checkpoint, import_hf_checkpoint
from megapipe.checkpointing.paths import find_checkpoint
from megapipe.config import ModelConfig
from megapipe.errors import CheckpointError, ConfigError
from megapipe.models.flops import flops_per_iteration
from megapipe.inference import GenerationError, SamplingParams, generate, score_continuations
from megapipe.inference.deadline import Deadline
from megapipe.inference.scoring import pipeline_logits
from megapipe.models import build_model_chunks
from megapipe.models.families.llama import llama_model_config
from megapipe.models.hf_llama import llama_from_hf
from megapipe.models.state_dict import local_state_dict
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

RTOL = 1e-5
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))
NEW = 32
ROUNDS = 4  # the rounds a deadline lets run in the checks below
TOKENIZER = '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, "unk_token": "a"}}'


def _hf_models():
    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, intermediate_size=96, vocab_size=211,
                  max_position_embeddings=96)
    models = {"llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
                  num_key_value_heads=2, tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 500.0}, **common)),
              "mistral": transformers.MistralForCausalLM(transformers.MistralConfig(
                  num_key_value_heads=4, tie_word_embeddings=False, **common)),
              "qwen2": transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
                  num_key_value_heads=2, tie_word_embeddings=True, **common))}
    with torch.no_grad():  # non-trivial norms and biases, so a swapped mapping shows up
        for model in models.values():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.2)
    return {name: model.eval() for name, model in models.items()}


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 211, (n,), generator=g).tolist() for n in (7, 3, 11, 5)]


def _reference_generation(model, prompts):
    # an explicit mask: transformers would otherwise mask out every token that equals pad_token_id
    return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _reference_scores(model, pairs):
    out = []
    for context, continuation in pairs:
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            logprobs = model(ids).logits[0].log_softmax(-1)
        out.append(sum(logprobs[len(context) - 1 + i, tok].item() for i, tok in enumerate(continuation)))
    return out


def _after_rounds(rounds: int, decides: bool) -> Deadline:
    """A deadline reached after ``rounds`` decode rounds on the rank that ``decides``; never elsewhere."""
    return Deadline(rounds if decides else None, clock=itertools.count().__next__)


def _layout_checks(rank, world_size, checkpoints, tokens, prompts, pairs):
    """Everything each layout computes; returned from global rank 0 (a first stage) and the last stage."""
    out = {}
    for t, p in LAYOUTS:
        ps = ParallelState.initialize(t, p)
        for name, directory in checkpoints.items():
            config = Common.read(find_checkpoint(directory)).model_config
            chunk = build_model_chunks("gpt", config, ps)[0].eval()
            load_weights(directory, "gpt", [chunk], ps, config)
            with torch.no_grad():
                logits = pipeline_logits(chunk, ps, config, tokens)
            if logits is not None and ps.tp_rank == 0:
                out[("logits", name, t, p)] = logits
            if name != "llama":
                continue
            for padding in ("left", "right"):
                for m in (None, 1):
                    greedy = SamplingParams(max_new_tokens=NEW, temperature=0.0)
                    result = generate([chunk], ps, config, prompts, greedy, padding=padding, microbatches=m)
                    out[("greedy", padding, m, t, p, ps.pp_rank)] = result
            deadline = _after_rounds(ROUNDS, ps.is_first_stage and ps.tp_rank == 0)
            cut = generate([chunk], ps, config, prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0),
                           deadline=deadline)
            out[("cut", t, p, ps.pp_rank)] = cut, deadline.cut
            sampled = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.95,
                                     repetition_penalty=1.3, seed=7)
            out[("sampled", t, p, ps.pp_rank)] = generate([chunk], ps, config, prompts, sampled)
            out[("scores", t, p)] = score_continuations([chunk], ps, config, pairs)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    models = _hf_models()
    checkpoints = {}
    for name, model in models.items():
        source = root / f"{name}-hf"
        model.save_pretrained(source, max_shard_size="100KB" if name == "llama" else "5GB")  # llama: an index
        (source / "tokenizer.json").write_text(TOKENIZER)
        checkpoints[name] = str(root / name)
        import_hf_checkpoint(str(source), checkpoints[name], SavedLayout(2, 2, 1))
    assert os.path.isfile(root / "llama-hf" / "model.safetensors.index.json")
    prompts = _prompts()
    pairs = [(prompts[0], prompts[1]), (prompts[2], [17]), (prompts[3], prompts[0])]
    tokens = torch.randint(0, 211, (3, 13), generator=torch.Generator().manual_seed(2))
    results = {}
    for rank_results in run_distributed(4, _layout_checks, checkpoints, tokens, prompts, pairs, timeout=300):
        results.update(rank_results)
    return models, checkpoints, tokens, prompts, pairs, results, root


def assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_imported_logits_equal_transformers_on_every_layout(world, name):
    models, _, tokens, _, _, results, _ = world
    with torch.no_grad():
        expected = models[name](tokens).logits
    for t, p in LAYOUTS:
        assert_close(results[("logits", name, t, p)], expected)


@pytest.mark.distributed
def test_greedy_generation_equals_transformers_on_every_layout(world):
    models, _, _, prompts, _, results, _ = world
    expected = _reference_generation(models["llama"], prompts)
    assert all(len(tokens) == NEW for tokens in expected)
    for t, p in LAYOUTS:
        for padding in ("left", "right"):
            for m in (None, 1):  # pipelined (one microbatch per stage) and naive decode
                for stage in {0, p - 1}:
                    assert results[("greedy", padding, m, t, p, stage)] == expected, (t, p, padding, m, stage)


@pytest.mark.distributed
def test_a_deadline_seen_by_one_rank_stops_every_rank_of_the_layout(world):
    models, _, _, prompts, _, results, _ = world
    expected = [tokens[:ROUNDS] for tokens in _reference_generation(models["llama"], prompts)]
    for t, p in LAYOUTS:
        assert results[("cut", t, p, 0)] == (expected, True), (t, p)
        assert results[("cut", t, p, p - 1)][0] == expected, (t, p)


@pytest.mark.distributed
def test_sampling_with_a_seed_is_the_same_on_every_layout(world):
    results = world[5]
    reference = results[("sampled", 1, 1, 0)]
    assert all(len(tokens) == 12 for tokens in reference)
    assert len({tuple(tokens) for tokens in reference}) == len(reference)
    for t, p in LAYOUTS:
        assert results[("sampled", t, p, 0)] == reference, (t, p)


@pytest.mark.distributed
def test_log_likelihoods_equal_transformers(world):
    models, _, _, _, pairs, results, _ = world
    expected = _reference_scores(models["llama"], pairs)
    for t, p in LAYOUTS:
        scores = results[("scores", t, p)]
        torch.testing.assert_close(torch.tensor([s for s, _ in scores]), torch.tensor(expected), rtol=RTOL, atol=0)
    assert results[("scores", 1, 1)][1][1] == (_greedy_next(models["llama"], pairs[1][0]) == 17)


def _greedy_next(model, context):
    with torch.no_grad():
        return int(model(torch.tensor([context])).logits[0, -1].argmax())


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_export_reloads_in_transformers_bit_exact_with_tokenizer(world, name):
    models, checkpoints, _, _, _, _, root = world
    target = root / f"{name}-exported"
    export_hf_checkpoint(checkpoints[name], str(target))
    back = type(models[name]).from_pretrained(target)
    original = models[name].state_dict()
    assert set(back.state_dict()) == set(original)
    for key, value in original.items():
        assert torch.equal(back.state_dict()[key], value), key
    exported = transformers.PreTrainedTokenizerFast.from_pretrained(target)  # Auto probes mistral-common
    assert [exported(word, add_special_tokens=False)["input_ids"] for word in ("a", "b")] == [[0], [1]]
    assert Common.read(find_checkpoint(checkpoints[name])).tokenizer == {"tokenizer_type": "HuggingFaceTokenizer",
                                                                         "tokenizer_model": "tokenizer.json"}


def _single(model):
    config = llama_model_config(model.config)
    ps = ParallelState.single()
    chunk = build_model_chunks("gpt", config, ps)[0].eval()
    chunk.load_state_dict(local_state_dict(llama_from_hf(model.state_dict(), config), chunk, ps, config))
    return chunk, ps, config


@pytest.mark.unit
def test_kv_cache_decode_equals_recomputation_without_cache():
    chunk, ps, config = _single(_hf_models()["qwen2"])
    prompts = _prompts()
    cached = generate([chunk], ps, config, prompts, SamplingParams(max_new_tokens=10, temperature=0.0),
                      padding="left")
    for prompt, new in zip(prompts, cached):
        sequence = list(prompt)
        for _ in range(10):  # the whole sequence again for every token, no cache
            with torch.no_grad():
                logits = chunk(None, {"tokens": torch.tensor([sequence])})[0, -1, : config.vocab_size]
            sequence.append(int(logits.argmax()))
        assert sequence[len(prompt):] == new


@pytest.mark.unit
def test_sampling_with_a_seed_does_not_depend_on_the_microbatches():
    """Each sequence draws from its own generator, seeded from the request's seed and the sequence's
    index, so splitting the batch differently, or dropping its last sequence, changes no sequence's tokens."""
    chunk, ps, config = _single(_hf_models()["llama"])
    sampled = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.3,
                             seed=7)
    whole = generate([chunk], ps, config, _prompts(), sampled, microbatches=1)
    assert generate([chunk], ps, config, _prompts(), sampled, microbatches=4) == whole
    assert generate([chunk], ps, config, _prompts()[:3], sampled, microbatches=2) == whole[:3]
    assert len({tuple(tokens) for tokens in whole}) == len(whole)  # the rows did not draw alike


@pytest.mark.unit
def test_stop_tokens_and_max_new_tokens():
    chunk, ps, config = _single(_hf_models()["llama"])
    prompts = _prompts()
    full = generate([chunk], ps, config, prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    stop = full[0][3]
    stopped = generate([chunk], ps, config, prompts, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                      stop_tokens=(stop,)))
    for row, tokens in enumerate(full):
        cut = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert stopped[row] == tokens[:cut]


@pytest.mark.unit
def test_a_deadline_cuts_every_row_at_the_same_round():
    chunk, ps, config = _single(_hf_models()["llama"])
    prompts, greedy = _prompts(), SamplingParams(max_new_tokens=8, temperature=0.0)
    full = generate([chunk], ps, config, prompts, greedy)
    for rounds in (0, 3):
        deadline = _after_rounds(rounds, decides=True)
        assert generate([chunk], ps, config, prompts, greedy, microbatches=2, deadline=deadline) == [
            tokens[:rounds] for tokens in full]
        assert deadline.cut
    never = _after_rounds(100, decides=True)
    assert generate([chunk], ps, config, prompts, greedy, deadline=never) == full and not never.cut


@pytest.mark.unit
def test_generation_bad_input_is_one_sentence():
    chunk, ps, config = _single(_hf_models()["llama"])
    with pytest.raises(GenerationError, match=r"^a prompt of 97 tokens is longer than --max-position-embeddings 96; "
                                              r"shorten the prompt\.$"):
        generate([chunk], ps, config, [[1] * 97], SamplingParams(max_new_tokens=1))
    with pytest.raises(GenerationError, match="exceeds --max-position-embeddings 96; generate at most 6 tokens"):
        generate([chunk], ps, config, [[1] * 90], SamplingParams(max_new_tokens=7))


@pytest.mark.unit
def test_flop_formula_counts_swiglu_and_grouped_query_attention():
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=300,
                         seq_length=24, ffn_hidden_size=96, swiglu=True, position_embedding_type="rope",
                         normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                         masked_softmax_fusion=False, untie_embeddings_and_output_weights=True)
    model = build_model_chunks("gpt", config, ParallelState.single())[0]
    tokens = torch.randint(0, config.vocab_size, (3, config.seq_length))
    with FlopCounterMode(display=False) as counter:
        model(None, {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(3, config.seq_length)}).backward()
    assert counter.get_total_flops() == flops_per_iteration(config, global_batch_size=3, recompute=False)


@pytest.mark.unit
@pytest.mark.parametrize("fields, message", [
    (dict(num_attention_heads=8, num_query_groups=3),
     "--num-attention-heads 8 is not divisible by --num-query-groups 3"),
    (dict(num_attention_heads=8, num_query_groups=2, t=4), "--num-query-groups 2 is not divisible by "
                                                          "--tensor-model-parallel-size 4"),
    (dict(rotary_percent=0.0), r"--rotary-percent 0.0 is outside \(0, 1\]"),
])
def test_model_option_errors_are_one_sentence(fields, message):
    t = fields.pop("t", 1)
    with pytest.raises(ConfigError, match=message):
        ModelConfig(hidden_size=64, **fields).validate(tensor_parallel=t)


@pytest.mark.unit
def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    config = transformers.GPTNeoXConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                        intermediate_size=32, vocab_size=50)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox")
    with pytest.raises(CheckpointError, match=r"holds a 'gpt_neox' model \(GPTNeoXForCausalLM\), which cannot be "
                                              r"imported; supported: .*LlamaForCausalLM \('llama'\), "
                                              r"MistralForCausalLM \('mistral'\), Qwen2ForCausalLM \('qwen2'\)\.$"):
        import_hf_checkpoint(str(tmp_path / "neox"), str(tmp_path / "out"), SavedLayout(1, 1, 1))


@pytest.mark.unit
def test_bert_encoder_without_heads_is_refused_or_gets_named_heads(tmp_path):
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50, max_position_embeddings=16)
    transformers.BertModel(config).save_pretrained(tmp_path / "encoder")
    with pytest.raises(CheckpointError, match="pass --initialize-missing-heads to start the masked-LM head and "
                                              r"sentence-order \(binary\) head from random weights"):
        import_hf_checkpoint(str(tmp_path / "encoder"), str(tmp_path / "out"), SavedLayout(1, 1, 1))
    done = import_hf_checkpoint(str(tmp_path / "encoder"), str(tmp_path / "out"), SavedLayout(1, 1, 1),
                                initialize_missing_heads=True)
    assert done.initialized_heads == ["masked-LM head", "sentence-order (binary) head"]
    assert done.lines()[-1].startswith("initialised: masked-LM head, sentence-order (binary) head")
