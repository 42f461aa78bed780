"""Host synchronisations of a whole training iteration, and exits agreed on without meeting.

``Trainer.count_synchronisations`` counts every host read of a tensor (on the CPU; CUDA's sync
debug mode on a GPU) in everything ``train_iteration`` does between two iterations: reading the
batch, the pipeline schedule with its messages, the gradient sync, the optimizer step with
clipping (and fp16 loss scaling), the learning-rate schedule, the loss and skip bookkeeping and
the exit check. Outside log, evaluation and save iterations that must be none, for m = 2 and
m = 8, for a flush schedule (1F1B) and PipeDream-2BW, in one process and in a 2-stage gloo
pipeline (one world for every check). The one read that remains by design, optimizer
post-validation's verdict (one per iteration), is counted exactly. Experts split over the two ranks
(e = 2), each padded to its capacity or dropless with the counts kept on the device, read nothing
either, with the all-to-all overlapped or not.

Exits: with nothing to agree on a boundary makes no collective; SIGTERM, ``--exit-duration-in-mins``
and the lease are agreed on one boundary late (``tests/test_post_validation.py`` checks a SIGTERM
on one rank of four), and ``pretrain_gpt.py`` at p = 2 stops every rank at the same, later,
iteration, saves and exits 0.
"""

import os
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megapipe.cli.parse import parse_run
from megapipe.parallel.launch import count_synchronisations, counting_synchronisations
from megapipe.training.exits import ExitConditions
from megapipe.testing.worlds import run_distributed
from megapipe.training.trainer import Trainer
from test_training_cli import TINY, run

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "1", "--mock-data", "--vocab-size", "128", "--train-iters", "100",
         "--log-interval", "100", "--eval-interval", "100", "--eval-iters", "1",
         "--untie-embeddings-and-output-weights"]  # 2BW needs untied embeddings; 1F1B runs the same model
COUNTED = 3  # iterations counted after one warm-up (lazy optimizer state)
# (schedule, m, extra flags); the default --clip-grad 1.0 clips at every step
CASES = [("1f1b", 2, ()), ("1f1b", 8, ()), ("2bw", 2, ()), ("2bw", 8, ())]
ONE_PROCESS_ONLY = [("1f1b", 8, ("--fp16",)),  # dynamic loss scaling: the skip decision stays on the device
                    ("1f1b", 2, ("--bf16", "--clip-grad", "1e-4")),
                    ("2bw", 8, ("--fp16", "--loss-scale", "1024"))]


def trainer(p: int, schedule: str, m: int, extra=()) -> Trainer:
    flags = FLAGS + ["--pipeline-model-parallel-size", str(p), "--pipeline-schedule", schedule,
                     "--global-batch-size", str(m), *extra]
    return Trainer(parse_run("gpt", flags, world_size=p))


def syncs_of(p: int, schedule: str, m: int, extra=()) -> int:
    """Host synchronisations of COUNTED iterations of this run; the pipeline is drained afterwards."""
    run_trainer = trainer(p, schedule, m, extra)
    count = run_trainer.count_synchronisations(COUNTED)
    run_trainer.engine.drain()
    run_trainer.exit_conditions.close()
    return count


@pytest.mark.unit
def test_the_count_sees_every_host_read():
    assert count_synchronisations(lambda: torch.ones(2).sum().item(), 3, torch.device("cpu")) == 3
    values = torch.arange(3.0)
    with counting_synchronisations(torch.device("cpu")) as found:
        bool(values[0]), float(values[1]), int(values[2]), values.tolist(), [0, 1][values.long()[1]]
        values.numpy()  # host memory by construction (a device tensor refuses it): no synchronisation
    assert [entry.split(" at ")[0] for entry in found] == [
        "Tensor.__bool__", "Tensor.__float__", "Tensor.__int__", "Tensor.tolist", "Tensor.__index__"]
    assert all(os.path.basename(__file__) in entry for entry in found), found  # where each read is


@pytest.mark.unit
def test_on_cuda_the_sync_debug_mode_counts_each_warning(monkeypatch):
    """The CUDA path's wiring, with the debug mode's switch and its warnings played here: every
    warning counts, repeated from one line too (no once-per-location filter), other warnings are
    shown, and the mode is restored."""
    modes = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        assert modes[-1] == "warn"
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")

    with pytest.warns(UserWarning, match="something else"):
        assert count_synchronisations(step, 3, torch.device("cuda")) == 3
    assert modes == [0, "warn", 0]


def one_process_checks(rank, world_size):
    counts = {case: syncs_of(1, *case) for case in CASES + ONE_PROCESS_ONLY}
    logging = trainer(1, "1f1b", 2, ("--log-interval", "2"))
    with pytest.raises(ValueError, match="--log-interval 2 falls within iterations 2-4, whose host"):
        logging.count_synchronisations(COUNTED)
    batches = logging.train_batches()
    logging.train_iteration(batches)
    with counting_synchronisations(logging.device) as found:
        logging.train_iteration(batches)  # iteration 2 logs: the window's losses and counters come to the host
    return counts, len(found)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_one_process_iterations_read_nothing_from_the_device():
    """A world of one in a process of its own (a process group here would leak into later tests)."""
    [(counts, log_reads)] = run_distributed(1, one_process_checks, timeout=240)
    assert counts == {case: 0 for case in CASES + ONE_PROCESS_ONLY}
    assert log_reads > 0  # and the count sees the trainer's reads where it makes them


# experts over both ranks (e = 2 at p = 1), each padded to its capacity (the all-to-all's splits are fixed), or
# dropless with the counts on the device (fixed buffers)
EXPERTS = ("--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--disable-bias-linear")
PADDED = ("--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity")
DROPLESS = ("--moe-grouped-gemm", "--moe-dropless-device-dispatch")


def expert_syncs(extra=()) -> int:
    flags = FLAGS + ["--pipeline-schedule", "1f1b", "--global-batch-size", "4", *EXPERTS, *extra]
    run_trainer = Trainer(parse_run("gpt", flags, world_size=2))
    count = run_trainer.count_synchronisations(COUNTED)
    run_trainer.exit_conditions.close()
    return count


def pipeline_checks(rank, world_size):
    counts = {(schedule, m): syncs_of(2, schedule, m) for schedule, m, _ in CASES}
    verdicts = syncs_of(2, "zb-h2", 2, ("--enable-optimizer-post-validation",))
    overlap = ("--overlap-moe-expert-parallel-comm",)
    experts = [expert_syncs(PADDED), expert_syncs(PADDED + overlap), expert_syncs(DROPLESS),
               expert_syncs(DROPLESS + overlap)]
    return counts, verdicts, exits_without_agreement(), experts


def exits_without_agreement():
    """Without a SIGTERM handler, --exit-duration-in-mins or a lease, boundaries make no collective
    (any would fail here) and --exit-interval alone stops every rank at its iteration."""
    nothing = SimpleNamespace(training=SimpleNamespace(exit_interval=2, exit_duration_in_mins=None,
                                                       exit_on_sigterm=False, cluster_lease=None,
                                                       exit_signal_grace_seconds=None))
    conditions = ExitConditions(nothing)
    collectives = (dist.all_reduce, dist.new_group)

    def refuse(*args, **kwargs):
        raise AssertionError("a collective at an iteration boundary with nothing to agree on")

    dist.all_reduce = dist.new_group = refuse
    try:
        return conditions.lag, [conditions.reason(iteration) for iteration in (1, 2)]
    finally:
        dist.all_reduce, dist.new_group = collectives


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_two_stage_pipeline_iterations_read_nothing_from_the_device():
    for counts, verdicts, exits, experts in run_distributed(2, pipeline_checks, timeout=540):
        assert counts == {(schedule, m): 0 for schedule, m, _ in CASES}
        assert experts == [0] * 4  # the expert all-to-all too (padded, dropless), alone and overlapped
        assert verdicts == COUNTED  # post-validation reads its verdict once per iteration, on every rank
        assert exits == (0, [None, "--exit-interval 2 at iteration 2"])


@pytest.mark.system
def test_exit_duration_stops_both_stages_one_iteration_later_and_saves(tmp_path):
    """Each rank's clock says stop after iteration 1; the ranks learn it of each other at the next
    boundary, so both save iteration 2 and exit 0 (a world of one stops after iteration 1:
    ``test_operations``)."""
    saved = tmp_path / "saved"
    result = run(TINY + ["--pipeline-model-parallel-size", "2", "--save", str(saved), "--exit-duration-in-mins",
                         "1e-9"], nproc=2, cache=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.findall(r"exiting on (.*)", result.stdout) == ["--exit-duration-in-mins 1e-09 at iteration 2"]
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
