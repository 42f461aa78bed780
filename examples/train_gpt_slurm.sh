#!/usr/bin/env bash
# Several nodes under Slurm, one command from the repository's directory:
#
#   sbatch --nodes 2 examples/train_gpt_slurm.sh [pretrain_gpt.py flags...]
#
# One task per node runs torchrun over that node's GPUs (the --gres below, or sbatch's --gres /
# SBATCH_GRES), all nodes joining one static rendezvous on the first node (its NodeAddr and a free
# port); every rank is a data-parallel replica unless the flags say otherwise (for example
# --tensor-model-parallel-size 8 within a node, --pipeline-model-parallel-size across nodes).
# torchrun ignores SIGTERM and lets the workers have it, so a time limit or a preemption saves and
# exits 0 (docs/training.md, Preemption); the log is slurm-JOBID.out in the directory of sbatch.
#SBATCH --job-name=megapipe-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --signal=TERM@120
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
GPUS=${SLURM_GPUS_ON_NODE:?run this script with sbatch and a --gres=gpu:N}
HOST=$(scontrol show node "$SLURMD_NODENAME" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
echo "Slurm job $SLURM_JOB_ID: $SLURM_NNODES nodes x $GPUS GPUs, rendezvous $HOST:$PORT" >&2
export PYTHONUNBUFFERED=1  # the log shows each line when it is printed
srun --kill-on-bad-exit=1 bash -c "trap '' TERM; exec python -m torch.distributed.run --nnodes $SLURM_NNODES \
    --nproc-per-node $GPUS --node-rank \$SLURM_NODEID --rdzv-backend static --rdzv-endpoint $HOST:$PORT \
    --rdzv-id megapipe-$SLURM_JOB_ID --signals-to-handle SIGINT,SIGHUP,SIGQUIT pretrain_gpt.py ${*@Q}"
