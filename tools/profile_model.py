"""Profile a GPT or BERT layer by layer on one device and save the JSON the planner reads.

Example::

    python tools/profile_model.py --num-layers 8 --hidden-size 256 --num-attention-heads 8 \\
        --seq-length 128 --vocab-size 512 --micro-batch-sizes 1,2,4 --output gpt.profile.json
    python tools/plan.py --profile gpt.profile.json --cluster cluster.json --global-batch-size 64

Records, for the embedding, every block and the head and for each micro-batch size: forward
and backward seconds (medians), backward seconds under activation recomputation, output and
stashed-activation bytes, and parameter counts. Runs on the CPU (one thread unless
--threads) or, with --device cuda, on the local GPU.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from megapipe.models.families import family  # noqa: E402
from megapipe.errors import ConfigError, reports_user_errors  # noqa: E402
from megapipe.planner.profiler import profile_model  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-type", choices=("gpt", "bert"), default="gpt")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--ffn-hidden-size", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--micro-batch-sizes", default="1,2,4", help="comma-separated, increasing")
    parser.add_argument("--iterations", type=int, default=10, help="timed runs per micro-batch size (medians kept)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:index]")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (one, like a training process)")
    parser.add_argument("--output", required=True)
    return parser.parse_args(argv)


@reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = tuple(int(b) for b in args.micro_batch_sizes.split(","))
    if list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
        raise ConfigError(f"--micro-batch-sizes {args.micro_batch_sizes} must be increasing positive integers.")
    config = family(args.model_type).model_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length, vocab_size=args.vocab_size,
        params_dtype=DTYPES[args.dtype], untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights)
    config.validate()
    profile = profile_model(args.model_type, config, sizes, args.iterations, args.warmup, torch.device(args.device))
    profile.save(args.output)
    print(f"{'layer':<12} " + " ".join(f"{'b=' + str(b):>26}" for b in sizes))
    print(f"{'':<12} " + " ".join(f"{'fwd/bwd/recompute ms':>26}" for _ in sizes))
    for layer in profile.layers:
        cells = [f"{f * 1e3:7.3f} {b * 1e3:8.3f} {r * 1e3:9.3f}"
                 for f, b, r in zip(layer.forward_s, layer.backward_s, layer.recompute_backward_s)]
        print(f"{layer.name:<12} " + " ".join(f"{c:>26}" for c in cells))
    print(f"profile written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
