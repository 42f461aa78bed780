"""What the overlaps buy on a node of several GPUs: step times of ``pretrain_gpt.py`` with each one off and on.

Over all the node's GPUs (n), a bf16 GPT of 8 layers at hidden 2048 and sequence 2048, the median
``elapsed time per iteration`` of the iterations after the first: ZeRO-1 with both overlaps against
unsharded data parallelism at d = n (aim: within 3%), tensor parallelism at t = n with sequence
parallelism against ``--no-async-tensor-model-parallel-allreduce`` (aim: 1.15x) and through torch's
symmetric memory (``--async-tensor-parallel``) against the point-to-point rings, and experts at e = n
with ``--overlap-moe-expert-parallel-comm`` on and off (aim: 1.1x) and with ``--moe-dropless-device-dispatch``
against the splits read on the host (no aim: fixed buffers carry more bytes, the host read stalls). The figures are noted with their
aims, not judged: a node's interconnect decides them. ZeRO-3 against FSDP2 is
``benchmarks/bench_data_parallel.py``'s comparison, which this step does not run. A dry run has no
GPUs to time and skips.
"""

from __future__ import annotations

import re
import statistics

from megapipe.acceptance.record import Context, Record
from megapipe.acceptance.runs import Finished, start

ITERATIONS = 6
MODEL = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
         "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--bf16", "--mock-data",
         "--vocab-size", "32000", "--train-iters", str(ITERATIONS), "--log-interval", "1", "--eval-interval", "100000",
         "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]
EXPERTS = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-grouped-gemm", "--disable-bias-linear",
           "--ffn-hidden-size", "4096", "--swiglu"]
ELAPSED = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def comparisons(world: int) -> dict[str, tuple[list[str], list[str], list[str], float]]:
    """Name -> (flags of both runs, the faster side's extra flags, the baseline's, the aim for baseline / faster)."""
    batch = ["--global-batch-size", str(4 * world)]
    return {
        f"ZeRO-1 with both overlaps vs unsharded, d = {world}": (
            batch, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], [], 0.97),
        f"t = {world} with sequence parallelism, overlap on vs off": (
            batch + ["--tensor-model-parallel-size", str(world), "--sequence-parallel"], [],
            ["--no-async-tensor-model-parallel-allreduce"], 1.15),
        f"t = {world} with sequence parallelism, symmetric memory vs rings": (
            batch + ["--tensor-model-parallel-size", str(world), "--sequence-parallel"], ["--async-tensor-parallel"],
            [], 1.0),
        f"e = {world}, expert all-to-all overlapped vs not": (
            ["--global-batch-size", str(2 * world)] + EXPERTS + ["--expert-model-parallel-size", str(world)],
            ["--overlap-moe-expert-parallel-comm"], [], 1.1),
        f"e = {world}, dropless dispatch with the counts on the device vs read on the host": (
            ["--global-batch-size", str(2 * world)] + EXPERTS + ["--expert-model-parallel-size", str(world)],
            ["--moe-dropless-device-dispatch"], [], 1.0),
    }


def run(record: Record, context: Context) -> None:
    if context.dry_run:
        record.skip("every comparison", "a dry run has no GPUs to time")
        return
    import torch

    world = torch.cuda.device_count()
    if world < 2:
        record.skip("every comparison", f"{world} GPU(s) visible: the comparisons need 2 or more")
        return
    for name, (common, faster, baseline, aim) in comparisons(world).items():
        times = {}
        for side, extra in (("baseline", baseline), ("faster", faster)):
            times[side] = _step_ms(Finished(f"{name}: {side}", start("pretrain_gpt.py", MODEL + common + extra,
                                                                        world)))
        if None in times.values():
            record.add(name, "failed", "a run failed or logged no iteration time (steps.log has its output)")
            continue
        ratio = times["baseline"] / times["faster"]
        record.add(name, "noted", f"baseline / faster {ratio:.3f} (aim {aim}): {times['baseline']:.1f} vs "
                                  f"{times['faster']:.1f} ms per iteration", ratio=ratio, aim=aim, **times)


def _step_ms(finished: Finished):
    """The median elapsed time per iteration after the first, or None when the run failed."""
    if finished.returncode != 0 or finished.timed_out:
        return None
    times = [float(value) for value in ELAPSED.findall(finished.stdout)][1:]
    return statistics.median(times) if times else None
