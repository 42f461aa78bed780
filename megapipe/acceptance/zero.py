"""ZeRO-1 and ZeRO-3 at d = 2 on this machine's own torch, the GPU hidden (gloo on the CPU: one GPU
cannot host two NCCL ranks), against unsharded data parallelism. fp32: sharding changes where sums
are taken, not their order across ranks (a reduce-scatter adds the same two values an all-reduce
adds), so the losses agree to 1e-5 relative; a wrong shard or a missed gather moves them far more."""

from __future__ import annotations

from megapipe.acceptance.record import Context, Record
from megapipe.acceptance.runs import CPU_MODEL, QUIET, run_together

ITERATIONS, RTOL = 3, 1e-5
LEVELS = {
    "ZeRO-1 (--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)":
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    "ZeRO-3 (--data-parallel-sharding-strategy optim_grads_params)":
        ["--data-parallel-sharding-strategy", "optim_grads_params"],
}


def run(record: Record, context: Context) -> None:
    common = CPU_MODEL + QUIET + ["--train-iters", str(ITERATIONS)]
    hidden = {"MEGAPIPE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    commands = {name: ("pretrain_gpt.py", common + flags, 2, hidden) for name, flags in LEVELS.items()}
    commands["unsharded"] = ("pretrain_gpt.py", common, 2, hidden)
    finished = run_together(commands)
    reference = finished["unsharded"]
    if not record.check("unsharded data parallelism, d = 2", reference.succeeded):
        return
    for name in LEVELS:
        record.check(name, lambda: _same_losses(finished[name], reference.losses()))


def _same_losses(result, expected: dict) -> str:
    result.succeeded()
    got = result.losses()
    assert sorted(got) == sorted(expected) == list(range(1, ITERATIONS + 1)), f"iterations {sorted(got)}"
    worst = max(abs(got[i] - expected[i]) / abs(expected[i]) for i in got)
    assert worst <= RTOL, ", ".join(f"{i}: {got[i]:.7f} vs {expected[i]:.7f}" for i in got)
    return f"{ITERATIONS} losses within {worst:.1e} relative of unsharded"
