"""``python -m megapipe.acceptance`` (``bash tools/gpu_check.sh``): the GPU acceptance run.

    bash tools/gpu_check.sh                          # every step; summary.md, steps.log, results.json in gpu-check/
    bash tools/gpu_check.sh --only kernels,attention # some steps
    bash tools/gpu_check.sh --dry-run                # on the CPU: every step that can run without a GPU
    bash tools/gpu_check.sh --multi                  # a node of several GPUs: parity of every dimension, overlaps
    bash tools/gpu_check.sh --micro-batch-size 2     # other arguments go to the benchmark step

Exits 0 when every step passed (or when there is no GPU and no --dry-run: nothing to check), else 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megapipe.acceptance import MULTI_STEPS, runner
from megapipe.errors import reports_user_errors


@reports_user_errors
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", default=os.path.join(runner.REPO, "gpu-check"), help="folder for the summary and logs")
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU every step that can, small shapes")
    parser.add_argument("--multi", action="store_true", help="the steps of a node with several GPUs (written for 8)")
    args, _ = parser.parse_known_args(argv)
    every = MULTI_STEPS if args.multi else runner.STEPS
    names = [step.name for step in every]
    parser.add_argument("--only", default="", help="comma-separated steps: " + ", ".join(names))
    args, benchmark_args = parser.parse_known_args(argv)
    only = [name for name in args.only.split(",") if name]
    unknown = sorted(set(only) - set(names))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such step; use some of {', '.join(names)}.")
    if not args.dry_run and not torch.cuda.is_available():
        print("tools/gpu_check.sh needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False): "
              "nothing to check here; --dry-run runs the steps that can run on the CPU.")
        return 0
    results = runner.run_all(args.out, args.dry_run, only, benchmark_args, every)
    return 0 if all(result.outcome == "passed" for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
