"""Text generation: megapipe against transformers' ``generate``, and pipelined against naive decode.

    python benchmarks/bench_generation.py            # ~3 min on an idle 2-core machine
    python benchmarks/bench_generation.py --quick    # smaller, a smoke test

1. One process, one thread: the same random LlamaForCausalLM (GQA, SwiGLU, RoPE) in
   transformers and, imported through ``hf_llama``, in megapipe; the same batch of prompts of
   different lengths (left padded, with an attention mask for transformers), greedy, the same
   number of new tokens. Rounds alternate the two; reported: tokens/s of each (median over
   rounds), the median of the per-round ratio, and the share of identical tokens.
2. p = 2 (two gloo processes, one thread each): the pipelined decode (two microbatches in
   flight, one per stage) against the naive one (the whole batch crossing both stages one
   token at a time), alternating, median ratio of tokens/s. Next to it the simulator's
   prediction: decoding K tokens is the forward-only interleaved schedule with v = K chunks
   per rank (chunk k on rank r is token k's pass through stage r, so microbatch j's token k+1
   follows its token k on the last stage), simulated with each stage's cost measured on one
   process for a decode step of the whole batch and of half of it. The last stage's logit
   layer costs the same for half a batch as for a whole one (it reads the whole output
   weight), so the pipelined decode pays it once per microbatch: it gains when the layers
   outweigh the logit layer, as in large models.
"""

from __future__ import annotations

import statistics
import time

import torch

from harness import cli
from harness.pairing import take_turns, timed
from harness.ratios import median_ratio
from megapipe.inference import SamplingParams, generate
from megapipe.inference.kv_cache import KVCache
from megapipe.models import build_model_chunks
from megapipe.models.gpt import GPTStage
from megapipe.models.families.llama import llama_model_config
from megapipe.models.hf_llama import llama_from_hf
from megapipe.models.state_dict import local_state_dict
from megapipe.parallel.state import ParallelState
from megapipe.schedules.catalog.forward_only import forward_only_schedule
from megapipe.schedules.analysis.simulate import CostModel, simulate
from megapipe.testing.worlds import run_distributed


def hf_model(args):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                      num_attention_heads=args.heads, num_key_value_heads=args.groups,
                                      intermediate_size=args.ffn, vocab_size=args.vocab, max_position_embeddings=512,
                                      initializer_range=0.2)
    return transformers.LlamaForCausalLM(config).eval()


def prompts(args):
    g = torch.Generator().manual_seed(1)
    lengths = [args.prompt - 3 * (i % 4) for i in range(args.batch)]
    return [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]


def megapipe_model(hf, ps):
    config = llama_model_config(hf.config)
    chunk = build_model_chunks("gpt", config, ps)[0].eval()
    chunk.load_state_dict(local_state_dict(llama_from_hf(hf.state_dict(), config), chunk, ps, config))
    return chunk, config


def hf_generate(hf, batch, new):
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(batch):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def versus_transformers(args):
    torch.set_num_threads(1)
    hf = hf_model(args)
    ps = ParallelState.single()
    ours, config = megapipe_model(hf, ps)
    batch = prompts(args)
    params = SamplingParams(max_new_tokens=args.new, temperature=0.0)
    tokens = args.batch * args.new
    systems = {"transformers": lambda: hf_generate(hf, batch, args.new),
               "megapipe": lambda: generate([ours], ps, config, batch, params)}
    outputs = {}

    def run(name: str, _) -> float:
        seconds, _, outputs[name] = timed(systems[name], barriers=False)
        return seconds

    with torch.no_grad():
        hf_generate(hf, batch, 2), generate([ours], ps, config, batch, SamplingParams(2, temperature=0.0))  # warm-up
        times = take_turns(systems, args.rounds, run)
    same = sum(a == b for x, y in zip(outputs["megapipe"], outputs["transformers"]) for a, b in zip(x, y)) / tokens
    rates = {name: statistics.median(tokens / t for t in times[name]) for name in ("megapipe", "transformers")}
    return rates, median_ratio(times["transformers"], times["megapipe"]), same


def step_time(stage, config, rows, context, repeats):
    """Seconds of one decode step of ``stage`` (one new position after ``context`` cached ones) for ``rows``."""
    cache = KVCache(context + 1)
    first = stage.pre_process
    inputs = (torch.randint(0, config.vocab_size, (rows, context + 1)) if first
              else torch.randn(context + 1, rows, config.hidden_size))
    prefill = {"tokens": inputs[:, :context]} if first else {}
    step = {"tokens": inputs[:, context:]} if first else {}
    with torch.no_grad():
        stage(None if first else inputs[:context], dict(prefill, kv_cache=cache, last_logits_only=True))
        cache.offset = context
        step.update(position_ids=torch.full((rows, 1), context), kv_cache=cache, last_logits_only=True,
                    attention_mask=torch.zeros(1, 1, 1, context + 1, dtype=torch.bool))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            stage(None if first else inputs[context:], step)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def simulated_speedup(args):
    """Pipelined over naive tokens/s at p = 2 from the simulator, with each stage's measured step cost."""
    torch.set_num_threads(1)
    hf = hf_model(args)
    config = llama_model_config(hf.config)
    ps = ParallelState.single()
    canonical = llama_from_hf(hf.state_dict(), config)
    half_layers = config.num_layers // 2
    stages = [GPTStage(config, ps, 0, half_layers, pre_process=True, post_process=False),
              GPTStage(config, ps, half_layers, config.num_layers, pre_process=False, post_process=True)]
    for stage in stages:
        stage.load_state_dict(local_state_dict(canonical, stage, ps, config))
        stage.eval()
    context = args.prompt + args.new // 2
    whole = [step_time(stage, config, args.batch, context, 20) for stage in stages]
    half = [step_time(stage, config, args.batch // 2, context, 20) for stage in stages]
    k = args.new  # virtual stage c * 2 + r is token c on rank r

    def makespan(m, costs):
        schedule = forward_only_schedule(2, m, k)
        return simulate(schedule, CostModel(forward=lambda stage: costs[stage % 2], backward=0)).makespan
    return makespan(1, whole) / makespan(2, half), whole, half


def measured_decode(rank, world_size, args):
    torch.set_num_threads(1)
    hf = hf_model(args)
    ps = ParallelState.initialize(pipeline=2)
    ours, config = megapipe_model(hf, ps)
    batch = prompts(args)
    params = SamplingParams(max_new_tokens=args.new, temperature=0.0)
    generate([ours], ps, config, batch, SamplingParams(2, temperature=0.0))  # warm-up
    microbatches = {"pipelined": None, "naive": 1}
    outputs = {name: [] for name in microbatches}

    def run(name: str, _) -> float:
        seconds, _, output = timed(lambda: generate([ours], ps, config, batch, params, microbatches=microbatches[name]))
        outputs[name].append(output)
        return seconds

    times = take_turns(microbatches, args.rounds, run)
    rates = {name: statistics.median(args.batch * args.new / t for t in times[name]) for name in microbatches}
    return median_ratio(times["naive"], times["pipelined"]), rates, outputs["pipelined"] == outputs["naive"]


def main(argv=None):
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32, help="longest prompt; others 3, 6, 9 tokens shorter")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.new, args.rounds = 8, 2
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.groups} query groups, "
          f"SwiGLU {args.ffn}, vocabulary {args.vocab}; {args.batch} prompts of {args.prompt - 9}-{args.prompt} "
          f"tokens, "
          f"{args.new} new tokens each, greedy, fp32, one thread per process")
    rates, ratio, same = versus_transformers(args)
    print(f"one process: megapipe {rates['megapipe']:.0f} tokens/s, transformers generate "
          f"{rates['transformers']:.0f} tokens/s: megapipe {ratio:.2f}x (median of {args.rounds} paired rounds); "
          f"identical tokens {same:.1%}")
    predicted, whole, half = simulated_speedup(args)
    ms = lambda costs: " and ".join(f"{c * 1e3:.2f}" for c in costs)  # noqa: E731
    print(f"p=2 simulated: pipelined decode {predicted:.2f}x the naive one's tokens/s (measured decode step of "
          f"stages 1 and 2: {ms(whole)} ms for {args.batch} sequences, {ms(half)} ms for {args.batch // 2})")
    ratio, rates, same = run_distributed(2, measured_decode, args, timeout=1200)[0]
    print(f"p=2 measured: pipelined {rates['pipelined']:.0f} tokens/s, naive {rates['naive']:.0f} tokens/s: "
          f"{ratio:.2f}x (median of {args.rounds} paired rounds); same tokens: {same}")


if __name__ == "__main__":
    main()
