#!/usr/bin/env bash
# One CPU process: a small GPT on the embedded corpus, bf16, logged every 10 iterations.
set -euo pipefail
cd "$(dirname "$0")/.."
python pretrain_gpt.py --bf16 --train-iters 300 --log-interval 10 --eval-interval 100 "$@"
