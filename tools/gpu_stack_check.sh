#!/usr/bin/env bash
# The GPU machines' software stack checked on a CPU, in the environment tools/gpu_stack_env.sh made
# (torch 2.11, Triton 3.6): three iterations of pretrain_gpt.py at each data-parallel sharding level
# on two processes, then the tests that exercise torch's APIs, Triton's kernels among them (in
# Triton's interpreter). CI runs it after the main suite (.ci/run).
#
#     bash tools/gpu_stack_check.sh VENV_DIR
set -euo pipefail
VENV=${1:?usage: bash tools/gpu_stack_check.sh VENV_DIR}
cd "$(dirname "$0")/.."
PY="$VENV/bin/python"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled PYTHONPATH=$PWD

echo "pretrain_gpt.py, 3 iterations at d=2, each data-parallel sharding level (torch $("$PY" -c 'import torch; print(torch.__version__)'))"
SMALL_GPT=(--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2
           --global-batch-size 8 --train-iters 3 --log-interval 1 --eval-iters 0 --mock-data --vocab-size 256)
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
for sharding in "--data-parallel-sharding-strategy no_shard" \
                "--data-parallel-sharding-strategy optim" \
                "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather" \
                "--data-parallel-sharding-strategy optim_grads" \
                "--data-parallel-sharding-strategy optim_grads_params"; do
    echo "  $sharding"
    # shellcheck disable=SC2086  # $sharding holds flags
    "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 pretrain_gpt.py "${SMALL_GPT[@]}" $sharding \
        > "$LOG" 2>&1 || { cat "$LOG"; exit 1; }
    grep -E "iteration +3/" "$LOG"
done

# The tests of the code that calls torch's version-sensitive APIs: process groups and collectives,
# gradient sync at each sharding level, the pipeline runtime and recomputation, distributed
# checkpoints, fake tensors, generation, and the fused kernels. One list, chosen to take about four
# minutes on 2 cores; the whole suite passes on this stack too (python -m pytest -q in VENV_DIR).
TESTS=(
    tests/test_parallel_state.py tests/test_tensor_parallel.py tests/test_pipeline_p2p.py  # process groups, collectives
    tests/test_tensor_parallel_overlap.py tests/test_exposure.py tests/test_device_exposure.py  # collectives behind products
    tests/test_collectives.py tests/test_peer_messages.py tests/test_device_choice.py
    tests/test_hang_watchdog.py tests/test_host_memory.py                                 # the job store, the heap
    tests/test_data_parallel_sharding.py tests/test_optim_distributed.py                   # gradient sync, ZeRO levels
    tests/test_optim_precision.py
    tests/test_pipeline_training.py tests/test_weight_versions.py tests/test_split_backward.py  # pipeline runtime
    tests/test_pipelining_crosscheck.py                        # schedules against torch.distributed.pipelining's
    tests/test_recompute.py tests/test_iteration_syncs.py
    tests/test_checkpoint_sharded.py tests/test_checkpoint_resume.py                       # checkpoints (DCP)
    tests/test_fake_device.py tests/test_fake_device_inference.py tests/test_fake_world.py # fake tensors
    tests/test_async_tensor_parallel_flags.py                  # symmetric memory's checks on this torch
    tests/test_generation_server.py tests/test_sampling.py                                 # inference
    tests/test_moe_layer.py tests/test_moe_hf.py tests/test_moe_expert_dispatch.py          # experts: grouped GEMM, all-to-all
    tests/test_moe_dropless_dispatch.py tests/test_pass_streams.py  # sizes on the device, a pair's two streams
    tests/test_context_parallel_kernels.py tests/test_context_attention.py  # SDPA's aten ops with lse, ring, all-to-all
    tests/test_context_parallel_documents.py                   # packed documents' unmasked calls
    tests/test_checkpoint_megatron.py                          # Megatron-core's dist_checkpointing on this torch
    tests/test_fusions.py tests/test_fusions_norms.py tests/test_fusions_softmax.py tests/test_fusions_llama.py
    tests/test_fusion_backend.py tests/test_fusions_column_sums.py
    tests/test_fused_cross_entropy.py tests/test_gradient_accumulation_fusion.py  # addmm into fp32, chunked loss
    tests/test_fp8.py tests/test_compiled_layers.py     # float8 dtypes and torch._scaled_mm's meta; dynamo's explain
    tests/test_bare_image.py tests/test_acceptance.py   # the GPU image's packages alone; the acceptance, dry
    tests/test_cuda.py tests/test_cuda_inference.py     # collected (they run on a GPU)
)
"$PY" -m pytest -q "${TESTS[@]}"
