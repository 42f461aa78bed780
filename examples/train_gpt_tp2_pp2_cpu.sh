#!/usr/bin/env bash
# Four CPU processes on one machine: tensor parallel 2 x pipeline parallel 2 (gloo), 1F1B schedule.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
torchrun --standalone --nproc_per_node=4 pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --micro-batch-size 4 --global-batch-size 32 --train-iters 200 --log-interval 10 "$@"
