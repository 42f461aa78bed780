#!/usr/bin/env bash
# Multi-node launch for any number of nodes: run this on every node with NNODES, NODE_RANK
# (0 .. NNODES-1) and MASTER_ADDR (node 0's address) set; extra arguments go to pretrain_gpt.py
# and override the defaults below.
#
# Layout: tensor parallel over the GPUS_PER_NODE processes of a node (its all-reduces stay on
# NVLink), pipeline parallel across nodes with p the largest divisor of NNODES (at most MAX_PP)
# that also divides NUM_LAYERS, interleaved with VIRTUAL chunks per rank when the layers allow,
# and data parallel over the rest of the nodes; the global batch is MICROBATCHES (rounded up to a
# multiple of p) micro-batches per data-parallel replica.
#
# Optional: HOST_ADDR (this node's address, for torchrun's --local-addr; needed where hostnames
# do not tell nodes apart, as on test hosts), MASTER_PORT (29500), RUN_ID, RDZV_TIMEOUT (seconds
# to wait for the rendezvous, 300), DATA (an indexed dataset prefix, or "mock" for random tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_LAYERS=${NUM_LAYERS:-24}
MAX_PP=${MAX_PP:-8}
VIRTUAL=${VIRTUAL:-2}
MICROBATCHES=${MICROBATCHES:-64}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-300}
DATA=${DATA:-data/my_text_document}

if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ && "$NODE_RANK" =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then
    echo "error: NNODES=$NNODES and NODE_RANK=$NODE_RANK must be whole numbers with 0 <= NODE_RANK < NNODES." >&2
    exit 2
fi
# the rendezvous host must answer before torchrun waits minutes on it: node 0 must own MASTER_ADDR
# (it hosts the store), every other node must find torchrun's rendezvous store there within
# RDZV_TIMEOUT (megapipe/launcher/rendezvous.py: the store's own protocol, not a bare TCP connect)
if (( NODE_RANK == 0 )); then
    if ! python -c "import socket, sys; socket.socket().bind((sys.argv[1], 0))" "$MASTER_ADDR" 2>/dev/null; then
        echo "error: MASTER_ADDR=$MASTER_ADDR is not an address of node 0, which hosts the rendezvous; set it to this node's address." >&2
        exit 2
    fi
elif ! python -m megapipe.launcher.rendezvous "$MASTER_ADDR" "$PORT" "$RDZV_TIMEOUT"; then
    exit 2  # it said why, in one sentence
fi

PP=1
for ((k = 1; k <= NNODES && k <= MAX_PP; k++)); do
    if (( NNODES % k == 0 && NUM_LAYERS % k == 0 )); then PP=$k; fi
done
DP=$((NNODES / PP))
M=$(( (MICROBATCHES + PP - 1) / PP * PP ))
LAYOUT=(--tensor-model-parallel-size "$GPUS_PER_NODE" --pipeline-model-parallel-size "$PP"
        --micro-batch-size 1 --global-batch-size $((M * DP)))
if (( PP > 1 && VIRTUAL > 1 && NUM_LAYERS / PP % VIRTUAL == 0 )); then
    LAYOUT+=(--num-layers-per-virtual-pipeline-stage $((NUM_LAYERS / PP / VIRTUAL)))
fi
if [[ "$DATA" == mock ]]; then
    INPUT=(--mock-data --vocab-size 50256)
else
    INPUT=(--data-path "$DATA" --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt)
fi
RDZV_CONF="join_timeout=$RDZV_TIMEOUT,is_host=$(( NODE_RANK == 0 ? 1 : 0 ))"
LOCAL=()
if [[ -n "${HOST_ADDR:-}" ]]; then LOCAL=(--local-addr "$HOST_ADDR"); fi
echo "node $NODE_RANK of $NNODES: tensor $GPUS_PER_NODE x pipeline $PP x data $DP" >&2

exec torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$PORT" --rdzv-id "${RUN_ID:-megapipe}" \
    --rdzv-conf "$RDZV_CONF" "${LOCAL[@]}" \
    pretrain_gpt.py "${LAYOUT[@]}" \
    --num-layers "$NUM_LAYERS" --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
    --max-position-embeddings 2048 --bf16 \
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-fraction 0.01 --train-iters 100000 "${INPUT[@]}" \
    --save checkpoints/gpt --save-interval 1000 --load checkpoints/gpt "$@"
