"""Serve a megapipe checkpoint over Megatron-LM's REST interface (PUT /api), on one process or under torchrun.

    python tools/run_text_generation_server.py --load ckpt/ --port 5000
    torchrun --nproc_per_node 4 tools/run_text_generation_server.py --load ckpt/ \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["Hello"], "tokens_to_generate": 16, "temperature": 0.8, "top_k": 40, "top_p": 0.9}'

Texts are read with the tokenizer the checkpoint carries (or the tokenizer flags', for a checkpoint
saved without one). PUT /loglikelihood scores (context, continuation) pairs. Every request is held to
the limits below before any rank works on it; requests run one at a time, in arrival order.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megapipe.errors import reports_user_errors  # noqa: E402
from megapipe.training.failures import report_user_error  # noqa: E402
from megapipe.inference.loading import layout_flags, load_for_inference  # noqa: E402
from megapipe.inference.server import serve  # noqa: E402
from megapipe.inference.server_limits import ServerLimits, add_limit_flags  # noqa: E402


@reports_user_errors(report=report_user_error)  # once per job under torchrun, as training does
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    layout_flags(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000, help="0 picks a free port (printed)")
    add_limit_flags(parser)
    args = parser.parse_args(argv)
    loaded = load_for_inference(args, reads_text="the server")
    serve(loaded, args.host, args.port, ServerLimits.from_args(args), announce=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
