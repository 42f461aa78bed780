"""Profile a GPT or BERT layer by layer on one device and save the JSON the planner and the schedule
search read.

The model is the training run's: give the same model and data flags as to ``pretrain_gpt.py``
(every one of its flags is accepted; none at all profiles the default run's model, vocabulary and
micro-batch size), so the profile fits that run::

    python tools/profile_model.py --output gpt.profile.json
    torchrun --nproc-per-node 2 pretrain_gpt.py --pipeline-model-parallel-size 2 \\
        --pipeline-schedule auto --schedule-profile gpt.profile.json

    python tools/profile_model.py --num-layers 8 --hidden-size 256 --num-attention-heads 8 \\
        --seq-length 128 --micro-batch-sizes 1,2,4 --output gpt.profile.json
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

from megapipe.cli.parse import config_from_argv  # noqa: E402
from megapipe.data.rank_data import run_tokenizer  # noqa: E402
from megapipe.errors import ConfigError, reports_user_errors  # noqa: E402
from megapipe.planner.profiler import profile_model  # noqa: E402


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """This tool's own flags, and the rest: the training run's flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Every other flag is the "
                                     "training script's (python pretrain_gpt.py --help): give the run's own.")
    parser.add_argument("--model-type", choices=("gpt", "bert"), default="gpt")
    parser.add_argument("--micro-batch-sizes", default=None,
                        help="comma-separated, increasing (default: the run's --micro-batch-size)")
    parser.add_argument("--iterations", type=int, default=10, help="timed runs per micro-batch size (medians kept)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:index]")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (one, like a training process)")
    parser.add_argument("--output", required=True)
    return parser.parse_known_args(argv)


@reports_user_errors
def main(argv=None) -> int:
    args, run_flags = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = config_from_argv(args.model_type, run_flags)
    sizes_text = args.micro_batch_sizes or str(config.training.micro_batch_size)
    sizes = tuple(int(b) for b in sizes_text.split(","))
    if list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
        raise ConfigError(f"--micro-batch-sizes {sizes_text} must be increasing positive integers.")
    model = config.model
    model.vocab_size = run_tokenizer(args.model_type, config).vocab_size  # as the training run sets it
    model.validate()
    profile = profile_model(args.model_type, model, sizes, args.iterations, args.warmup, torch.device(args.device))
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
