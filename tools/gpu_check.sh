#!/usr/bin/env bash
# GPU acceptance in one command: the tests marked `cuda`, then benchmarks/bench_single_device.py for
# GPT-350M and GPT-1.3B at sequence 2048 in bf16, summed up in one table (tools/gpu_check.py).
# On a machine without a CUDA device it says so and exits 0. Works offline.
#
#     bash tools/gpu_check.sh                         # raw outputs in gpu-check/
#     bash tools/gpu_check.sh --micro-batch-size 2    # extra flags go to the benchmark
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" tools/gpu_check.py "$@"
