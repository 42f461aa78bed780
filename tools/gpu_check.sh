#!/usr/bin/env bash
# GPU acceptance in one command, within 8 minutes on a bare GPU machine (megapipe/acceptance: the steps
# and their time budgets). Writes summary.md, steps.log and results.json to gpu-check/ (--out DIR).
# On a machine without a CUDA device it says so and exits 0; --dry-run runs on the CPU what can.
#
#     bash tools/gpu_check.sh                         # every step
#     bash tools/gpu_check.sh --only kernels,attention
#     bash tools/gpu_check.sh --micro-batch-size 2    # other flags go to the benchmark
#     bash tools/gpu_check.sh --multi                 # a node of several GPUs: every dimension, the overlaps
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" tools/gpu_check.py "$@"
