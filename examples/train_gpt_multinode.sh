#!/usr/bin/env bash
# Multi-node GPU launch: run this on every node with NODE_RANK set (0 .. NNODES-1) and MASTER_ADDR
# pointing at node 0. 8 GPUs per node: tensor parallel 8 inside a node, pipeline across nodes,
# interleaved 1F1B, bf16, data from an indexed dataset with the GPT-2 tokenizer.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
DATA=${DATA:-data/my_text_document}
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc_per_node 8 \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RUN_ID:-megapipe}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size "$NNODES" \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
    --num-layers-per-virtual-pipeline-stage 3 \
    --micro-batch-size 1 --global-batch-size 512 --bf16 \
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-fraction 0.01 --train-iters 100000 \
    --data-path "$DATA" --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
    --save checkpoints/gpt --save-interval 1000 --load checkpoints/gpt "$@"
