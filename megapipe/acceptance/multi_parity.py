"""Every parallel dimension on a node of several GPUs against one GPU: fp32 losses within 1e-5.

``pretrain_gpt.py`` under torchrun over all the node's GPUs (n, 8 on the node this is written for), one
run per case: every synchronous pipeline schedule at p = 2 and p = 4 (the rest data parallel), tensor
parallelism with sequence parallelism at t = 2 and t = n (at t = n also through symmetric memory,
``--async-tensor-parallel``), context parallelism at c = 2 (ring and all-to-all, and the ring with packed
documents' unmasked calls: mock data holds one document per sample), experts at e = 2 with grouped products
(also dropless with the counts on the device, and overlapped pairs on two streams), ZeRO-1 with both overlaps
and ZeRO-3 at d = n;
each against the same model and global batch on one GPU. In fp32 a layout changes only where sums
are taken (partial products summed over ranks, microbatches accumulated in another order), ~1e-7
relative; a lost message, a wrong shard or a mis-ordered microbatch moves the losses by far more.
The asynchronous schedules (PipeDream, 2BW) train with stale weights by design and are checked
against their emulator in the suite instead.

A dry run (``--dry-run``) resolves every case's flags for a world of 8 and runs one case of each
dimension on 4 CPU processes under gloo.
"""

from __future__ import annotations

from megapipe.acceptance.record import Context, Record
from megapipe.acceptance.runs import Finished, start
from megapipe.cli.parse import parse_run
from megapipe.errors import UserError
from megapipe.schedules.catalog import schedule_descriptor, schedule_names

ITERATIONS, RTOL = 3, 1e-5
NODE = 8  # the world the cases are written for
LAYERS = 8
CONCURRENT = 4  # runs at once on the node (each over every GPU: tiny models, NCCL communicators of their own)
GPU_SHAPE = ["--num-layers", str(LAYERS), "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128"]
CPU_SHAPE = ["--num-layers", str(LAYERS), "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32"]
COMMON = ["--micro-batch-size", "1", "--global-batch-size", "16", "--max-position-embeddings", "128",
          "--train-iters", str(ITERATIONS), "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
          "--lr", "1e-3", "--lr-warmup-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--mock-data", "--vocab-size", "256"]
EXPERTS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm", "--disable-bias-linear"]
# one case of each dimension for the dry run
DRY_RUN_CASES = ("p = 2, 1f1b", "t = 2, sequence parallel", "c = 2, p2p", "e = 2, grouped experts", "ZeRO-3, d = n")


def _synchronous_schedules() -> list[str]:
    return [name for name in schedule_names() if not schedule_descriptor(name).asynchronous]


def cases(world: int) -> dict[str, list[str]]:
    """Name -> the flags of one run over ``world`` ranks (the model's flags apart)."""
    out = {}
    for p in (2, 4):
        for schedule in _synchronous_schedules():
            # two model chunks per rank for the schedules that take more than one (interleaved, V)
            virtual = [] if schedule_descriptor(schedule).sizes.most_chunks == 1 else [
                "--num-layers-per-virtual-pipeline-stage", str(LAYERS // (2 * p))]
            out[f"p = {p}, {schedule}"] = ["--pipeline-model-parallel-size", str(p), "--pipeline-schedule",
                                          schedule, *virtual]
    for t in sorted({2, world}):
        out[f"t = {t if t == 2 else 'n'}, sequence parallel"] = ["--tensor-model-parallel-size", str(t),
                                                                 "--sequence-parallel"]
    out["t = n, sequence parallel, symmetric memory"] = ["--tensor-model-parallel-size", str(world),
                                                         "--sequence-parallel", "--async-tensor-parallel"]
    for comm in ("p2p", "a2a"):
        out[f"c = 2, {comm}"] = ["--context-parallel-size", "2", "--cp-comm-type", comm]
    out["e = 2, grouped experts"] = EXPERTS + ["--expert-model-parallel-size", "2"]
    out["e = 2, grouped experts, dropless device dispatch"] = EXPERTS + ["--expert-model-parallel-size", "2",
                                                                         "--moe-dropless-device-dispatch"]
    out["e = 2, grouped experts, overlapped pairs on two streams"] = EXPERTS + [
        "--expert-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"]
    out["c = 2, p2p, packed documents"] = ["--context-parallel-size", "2", "--reset-attention-mask",
                                           "--reset-position-ids"]
    out["ZeRO-1, d = n"] = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    out["ZeRO-3, d = n"] = ["--data-parallel-sharding-strategy", "optim_grads_params"]
    return out


def run(record: Record, context: Context) -> None:
    shape = CPU_SHAPE if context.dry_run else GPU_SHAPE
    if context.dry_run:  # every case's flags hold at the node's size
        for name, flags in cases(NODE).items():
            record.check(f"flags of {name} at {NODE} ranks", lambda flags=flags: _resolves(shape + COMMON + flags))
    world = 4 if context.dry_run else _gpus()
    if world < 2:
        record.skip("every case", f"{world} GPU(s) visible: the multi-GPU parity needs 2 or more")
        return
    chosen = {name: flags for name, flags in cases(world).items()
              if not context.dry_run or name in DRY_RUN_CASES}
    runnable = {name: flags for name, flags in chosen.items() if _fits(record, name, shape + COMMON + flags, world)}
    references = {"dense": _launch(shape + COMMON, None), "experts": _launch(shape + COMMON + EXPERTS, None)}
    expected = {kind: Finished(f"one device, {kind}", process) for kind, process in references.items()}
    names = list(runnable)
    for first in range(0, len(names), CONCURRENT):
        batch = names[first:first + CONCURRENT]
        started = {name: _launch(shape + COMMON + runnable[name], world) for name in batch}
        for name, process in started.items():
            finished = Finished(f"{name} on {world} ranks", process)
            reference = expected["experts" if "experts" in name else "dense"]
            record.check(f"{name} on {world} ranks", lambda f=finished, r=reference: _same_losses(f, r))


def _launch(flags: list[str], world):
    return start("pretrain_gpt.py", flags, world)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _resolves(flags: list[str]) -> str:
    plan = parse_run("gpt", flags, world_size=NODE)
    return f"m = {plan.microbatches}"


def _fits(record: Record, name: str, flags: list[str], world: int) -> bool:
    """Whether the case's layout divides this world; skipped with the reason where not."""
    try:
        parse_run("gpt", flags, world_size=world)
    except UserError as error:
        record.skip(f"{name} on {world} ranks", str(error))
        return False
    return True


def _same_losses(result: Finished, reference: Finished) -> str:
    reference.succeeded()
    result.succeeded()
    got, expected = result.losses(), reference.losses()
    assert sorted(got) == sorted(expected) == list(range(1, ITERATIONS + 1)), f"iterations {sorted(got)}"
    worst = max(abs(got[i] - expected[i]) / abs(expected[i]) for i in got)
    assert worst <= RTOL, ", ".join(f"{i}: {got[i]:.7f} vs {expected[i]:.7f}" for i in got)
    return f"{ITERATIONS} losses within {worst:.1e} relative of one device's"
