"""Generate text from a megapipe checkpoint, on one process or a (t, p) layout under torchrun.

    python tools/generate.py --load ckpt/ --prompt "Once upon a time" --max-new-tokens 32 --greedy
    torchrun --nproc_per_node 4 tools/generate.py --load ckpt/ --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --prompt "a" --prompt "bb" --temperature 0.8 --top-p 0.9

Prompts are text (``--prompt``, read with the tokenizer the checkpoint carries) or space-separated
token ids (``--prompt-ids``). Prints each prompt with its continuation, one line per prompt, on
global rank 0: as text when there is a tokenizer, else as ids.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch.distributed as dist  # noqa: E402

from megapipe.errors import reports_user_errors  # noqa: E402
from megapipe.training.failures import report_user_error  # noqa: E402
from megapipe.inference import SamplingParams, generate  # noqa: E402
from megapipe.inference.sampling import stop_tokens_or_end_of_text  # noqa: E402
from megapipe.inference.loading import layout_flags, load_for_inference  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    layout_flags(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for a batch)")
    parser.add_argument("--prompt-ids", action="append", default=[], help="a prompt as space-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--greedy", action="store_true", help="the most likely token each step")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--stop-token", type=int, action="append", default=None,
                        help="a token id that ends a sequence (repeat for several); default: the tokenizer's "
                             "end-of-text token")
    parser.add_argument("--ignore-eod", action="store_true", help="generate --max-new-tokens past end-of-text")
    parser.add_argument("--padding", choices=("left", "right"), default="left")
    parser.add_argument("--naive-decode", action="store_true", help="one microbatch (no pipelined decode)")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


@reports_user_errors(report=report_user_error)  # once per job under torchrun, as training does
def main(argv=None) -> int:
    args = parse_args(argv)
    loaded = load_for_inference(args, reads_text="--prompt" if args.prompt else None)
    prompts = [loaded.tokenizer.tokenize(text) for text in args.prompt]
    prompts += [[int(t) for t in ids.split()] for ids in args.prompt_ids]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                            top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                            stop_tokens=stop_tokens_or_end_of_text(args.stop_token or (() if args.ignore_eod else None),
                                                                   loaded.tokenizer), seed=args.seed)
    outputs = generate(loaded.chunks, loaded.ps, loaded.config, prompts, params, padding=args.padding,
                       microbatches=1 if args.naive_decode else None)
    if dist.get_rank() == 0:
        for prompt, new in zip(prompts, outputs):  # each prompt followed by its continuation
            ids = prompt + new
            print(loaded.tokenizer.detokenize(ids) if loaded.tokenizer is not None else " ".join(map(str, ids)))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
