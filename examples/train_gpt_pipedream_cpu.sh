#!/usr/bin/env bash
# Three CPU processes: PipeDream's "2-1" configuration. Layer 0 (with the embedding) runs on two
# workers that take microbatches in turn (1F1B-RR), layers 1-3 (with the head) on the third;
# weight stashing, an update on every stage after every backward, no flushes.
# A plan written by `tools/plan.py --pipedream --plan-out plan.json` can replace the plan below.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
torchrun --standalone --nproc_per_node=3 pretrain_gpt.py \
    --pipeline-stages 0:1x2,1:4x1 --pipeline-schedule pipedream --untie-embeddings-and-output-weights \
    --micro-batch-size 4 --global-batch-size 16 --train-iters 200 --log-interval 10 "$@"
