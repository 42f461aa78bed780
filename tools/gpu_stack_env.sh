#!/usr/bin/env bash
# Makes a virtual environment with the GPU machines' software stack: torch 2.11.0 as published (its
# CUDA 13 libraries and Triton 3.6 come with it; on a machine without a GPU it runs on the CPU),
# then megapipe and its test tools through install.sh, which pins every later install to that torch.
# CI runs the torch-facing tests in it (.ci/run); on a CPU, Triton's kernels run in its interpreter.
#
#     bash tools/gpu_stack_env.sh .venv-gpu-stack    # then: .venv-gpu-stack/bin/python -m pytest ...
set -euo pipefail
GPU_STACK_TORCH=2.11.0
VENV=${1:?usage: bash tools/gpu_stack_env.sh VENV_DIR}
cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "torch==${GPU_STACK_TORCH}"
PYTHON="$VENV/bin/python" bash install.sh
