#!/usr/bin/env bash
# A small Llama-shaped model (RoPE, SwiGLU, grouped-query attention, RMSNorm, no biases, untied
# embeddings: --model-preset llama-tiny) on four CPU processes, tensor 2 x pipeline 2, sequence
# parallel, then greedy generation from the checkpoint (which carries its tokenizer) with the same
# layout, printed as text.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
torchrun --standalone --nproc_per_node=4 pretrain_gpt.py --model-preset llama-tiny \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
    --micro-batch-size 4 --global-batch-size 32 --train-iters 200 --log-interval 10 --save ckpt-llama "$@"
torchrun --standalone --nproc_per_node=4 tools/generate.py --load ckpt-llama \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --prompt "The " --greedy
