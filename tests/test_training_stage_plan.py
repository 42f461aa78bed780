"""``--pipeline-stages``: the training scripts run a stage plan (unequal stages, replicated stages).

Two plans of a 4-layer GPT against one process training the same flags without a plan:

* ``0:1x2,1:4x2`` on 4 ranks: two parallel pipelines whose stages hold 1 and 3 layers, with
  the flush schedule 1F1B. That is gradient accumulation over the same global batch, so every
  step's mean loss equals the single process's within 1e-5 relative (the data-parallel
  all-reduce and the split of the batch change only the order of fp32 sums: ~1e-7 measured).
* ``0:1x2,1:4x1`` on 3 ranks: PipeDream's "2-1" configuration under 1F1B-RR, where every rank
  reads the whole batch and the schedule routes microbatch i to replica i % 2 of stage 0. With
  the learning rate at 0 no update changes a weight, so every microbatch loss must equal the
  single process's loss for that microbatch: this checks that each microbatch of every batch
  is trained exactly once, by the stages the plan names. (The update rule of 1F1B-RR itself is
  checked against a sequential emulator in ``test_async_training.py``.) The same on 6 ranks with
  each worker's sequences split over 2 context ranks (``--context-parallel-size 2``): the same
  losses within 1e-5 (context parallelism sums attention in another order).

Dropout is off, so a microbatch's loss depends only on the weights and the data.
"""

import pytest
import torch.distributed as dist

from checkpoint_helpers import session_cache
from megapipe.cli.parse import parse_config, parse_run
from megapipe.errors import ConfigError
from megapipe.training.trainer import Trainer
from megapipe.testing.worlds import run_distributed

pytestmark = pytest.mark.timeout(600)

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1", "--train-iters", "3",
         "--eval-interval", "1000", "--eval-iters", "1", "--fusion-backend", "eager", "--lr-warmup-iters", "1",
         "--make-vocab-size-divisible-by", "16", "--hidden-dropout", "0", "--attention-dropout", "0"]
FLUSH_PLAN = ["--pipeline-stages", "0:1x2,1:4x2", "--pipeline-schedule", "1f1b"]
ROUND_ROBIN = ["--pipeline-stages", "0:1x2,1:4x1", "--pipeline-schedule", "pipedream", "--lr", "0", "--min-lr", "0",
               "--untie-embeddings-and-output-weights"]


def _train(argv: list[str], cache: str) -> tuple[Trainer, list[list[float]]]:
    """Train ``FLAGS + argv``; the microbatch losses of every engine call, drains included."""
    plan = parse_run("gpt", FLAGS + argv + ["--data-cache-path", cache], world_size=dist.get_world_size())
    trainer = Trainer(plan)
    calls = []
    for name in ("train_batch", "drain"):
        method = getattr(trainer.engine, name)

        def recording(*args, method=method):
            result = method(*args)
            calls.append(result.losses)
            return result
        setattr(trainer.engine, name, recording)
    trainer.train()
    return trainer, calls


def _planned(rank, world_size, argv, cache):
    trainer, calls = _train(argv, cache)
    ps = trainer.ps
    return dict(losses=calls, last=ps.is_last_stage and ps.tp_rank == 0 and ps.cp_rank == 0, stage=ps.pipeline_stage,
                layers=[name for name, _ in trainer.chunks[0].named_parameters() if name.endswith("qkv.weight")],
                m=trainer.m, batch_slice=ps.batch_slice)


def _single(rank, world_size, argvs, cache):
    return [_train(argv, cache)[1] for argv in argvs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = session_cache(tmp_path_factory)
    single = run_distributed(1, _single, [[], ["--lr", "0", "--min-lr", "0", "--untie-embeddings-and-output-weights"]],
                             cache, timeout=300)[0]
    flush = run_distributed(4, _planned, FLUSH_PLAN, cache, timeout=300)
    round_robin = run_distributed(3, _planned, ROUND_ROBIN, cache, timeout=300)
    context = run_distributed(6, _planned, ROUND_ROBIN + ["--context-parallel-size", "2"], cache, timeout=300)
    return single, flush, round_robin, context


def _layer_indices(names: list[str]) -> list[int]:
    return sorted(int(part) for name in names for part in name.split(".") if part.isdigit())


@pytest.mark.distributed
def test_stages_hold_the_planned_layers(runs):
    _, flush, round_robin, context = runs
    for ranks in (flush, round_robin, context):
        for result in ranks:
            assert _layer_indices(result["layers"]) == ([0] if result["stage"] == 0 else [1, 2, 3])
    assert [r["stage"] for r in round_robin] == [0, 0, 1]
    assert [r["stage"] for r in context] == [0, 0, 0, 0, 1, 1]  # each worker 2 context ranks
    assert [(r["m"], r["batch_slice"]) for r in round_robin] == [(4, (0, 1))] * 3  # the whole batch, 4 microbatches
    assert sorted((r["m"], r["batch_slice"]) for r in flush) == [(2, (0, 2))] * 2 + [(2, (1, 2))] * 2


@pytest.mark.distributed
def test_parallel_pipelines_of_unequal_stages_equal_gradient_accumulation(runs):
    single, flush, _, _ = runs
    expected = [sum(step) / len(step) for step in single[0] if step]
    last = [r["losses"] for r in flush if r["last"]]
    assert len(last) == 2  # one last stage per pipeline, each with half of every batch
    actual = [sum(a + b) / len(a + b) for a, b in zip(*last) if a + b]
    assert len(actual) == len(expected) == 3
    assert actual == pytest.approx(expected, rel=1e-5, abs=0)


@pytest.mark.distributed
@pytest.mark.parametrize("run, rel", [(2, 1e-6), (3, 1e-5)], ids=["c1", "c2"])
def test_round_robin_trains_every_microbatch_once_on_the_planned_stages(runs, run, rel):
    single = runs[0]
    expected = sorted(loss for step in single[1] for loss in step)
    (last,) = [r["losses"] for r in runs[run] if r["last"]]
    actual = sorted(loss for call in last for loss in call)
    assert len(actual) == len(expected) == 12
    assert actual == pytest.approx(expected, rel=rel, abs=0)


@pytest.mark.unit
@pytest.mark.parametrize("argv, world, message", [
    (["--pipeline-stages", "0:1x2,1:4x1"], 3, "only --pipeline-schedule pipedream"),
    (["--pipeline-stages", "0:1x2,1:4x1", "--pipeline-schedule", "pipedream"], 4, "the world has 4"),
    (["--pipeline-stages", "0:1,1:3", "--pipeline-schedule", "1f1b"], 2, "leaves layers 3..3 unassigned"),
    (["--pipeline-stages", "0:1,1:4", "--pipeline-model-parallel-size", "4"], 2, "names 2 stages"),
])
def test_bad_plans_on_the_command_line(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse_config("gpt", FLAGS + argv, world_size=world)
