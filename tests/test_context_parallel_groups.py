"""Context-parallel process groups and gradient averaging over data x context ranks, on 4 gloo processes.

One spawned world runs every check. The groups each rank joins must be the ones the layout lists
(``test_context_layout.py`` checks the layout by brute force). Gradients: at (c, d) = (2, 2) each
context rank contributes a known fraction of its replica's gradient, scaled by c as the loss is
(Megatron's rule), so the average over the d x c ranks is the mean of the replicas' gradients; two
SGD steps with momentum at every sharding level, overlap on and off, must give the parameters and
the global gradient norms a one-process run with that mean gradient gives. The gradient values are
small dyadic numbers, so the sums are exact; the norm's partial sums are added in another order
(~1e-7 relative).
Checkpoints: a ZeRO-1 run at (c, p) = (2, 2), its optimizer state sharded over the two context
ranks, saves what it holds, and runs at c = 1 (d = 4) and c = 4 (d = 1), sharded four ways, load
exactly that state.
"""

import os

import pytest
import torch
import torch.distributed as dist

from checkpoint_helpers import session_cache, train
from megapipe.checkpointing.offline import read_checkpoint
from megapipe.checkpointing.state import param_entries
from megapipe.config.sharding import ShardingLevel
from megapipe.optim import GradBuffers, OptimizerConfig, build_optimizer, finalize_model_grads
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

# (tensor, pipeline, context, comm type, hierarchical sizes): every way 4 ranks hold c > 1
LAYOUTS = ((1, 1, 2, "p2p", None), (2, 1, 2, "all_gather", None), (1, 2, 2, "a2a", None), (1, 1, 4, "p2p", None),
           (1, 1, 4, "a2a+p2p", (2, 2)))
GROUPS = ("tensor", "context", "data", "data_context", "pipeline", "model_parallel", "context_a2a", "context_ring")
SHAPES = {"weight": (5, 3), "bias": (7,)}  # odd sizes: sharded buckets hold padding
FRACTIONS = (0.25, 0.75)  # of its replica's gradient, per context index (c = 2)
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]


def check_groups(rank: int) -> None:
    for t, p, c, comm_type, hierarchical in LAYOUTS:
        ps = ParallelState.initialize(tensor=t, pipeline=p, context=c, cp_comm_type=comm_type,
                                      hierarchical_context=hierarchical)
        layout, where = ps.layout, ps.layout.coords(rank)
        for name in GROUPS:
            mine = [g for g in getattr(layout, f"{name}_groups")() if rank in g]
            if name.startswith("context_") and hierarchical is None:
                assert mine == [] and ps.groups.get(name) is None, (name, mine)
                continue
            assert len(mine) == 1, (name, mine)
            assert list(dist.get_process_group_ranks(ps.groups[name])) == mine[0], (layout, name)
            assert ps.members[name] == mine[0]
        d = 4 // (t * p * c)
        assert (ps.cp_size, ps.cp_rank, ps.dp_size, ps.dp_rank) == (c, where.context, d, where.data)
        assert (ps.dp_cp_size, ps.dp_cp_rank) == (c * d, where.context + c * where.data)
        assert ps.batch_slice == (where.data, d)  # the context ranks of a replica read the same samples
        groups = ps.context_groups
        assert (groups.group, groups.index, groups.size, groups.comm_type) == (ps.cp_group, where.context, c,
                                                                              comm_type)
        assert groups.ranks == tuple(ps.members["context"])
        if hierarchical is not None:
            assert groups.a2a_ranks == tuple(ps.members["context_a2a"]) and len(groups.a2a_ranks) == hierarchical[0]
            assert groups.ring_ranks == tuple(ps.members["context_ring"]) and len(groups.ring_ranks) == hierarchical[1]
        count = torch.ones(())
        dist.all_reduce(count, group=ps.dp_cp_group)
        assert count.item() == c * d


def replica_grad(name: str, replica: int, step: int) -> torch.Tensor:
    """Replica ``replica``'s whole-sequence gradient of ``name`` at ``step``: dyadic, so sums are exact."""
    numel = torch.Size(SHAPES[name]).numel()
    return (torch.arange(numel, dtype=torch.float32).view(SHAPES[name]) / 4 - 2 + 8 * replica + 16 * step
            + 32 * len(name))


def fresh_model() -> torch.nn.ParameterDict:
    generator = torch.Generator().manual_seed(5)
    return torch.nn.ParameterDict({name: torch.nn.Parameter(torch.randn(shape, generator=generator))
                                   for name, shape in SHAPES.items()})


def train_two_steps(ps: ParallelState, strategy: str, overlap: bool, grad_of) -> tuple[dict, list[float]]:
    """Two SGD steps with momentum whose backward gives ``grad_of(name, step)``: the whole weights after,
    and the global gradient norms. SGD is linear in the gradient (Adam and clipping would hide a wrong
    scale), and the clipping threshold is above the norm, which is still reduced and reported."""
    model = fresh_model()
    level = ShardingLevel(strategy)
    grads = GradBuffers([model], ps, bucket_size=8, level=level, overlap_grad_reduce=overlap,
                        overlap_param_gather=overlap and level.shards_optimizer)
    config = OptimizerConfig(optimizer="sgd", lr=0.01, sgd_momentum=0.9, clip_grad=1e6, weight_decay=0.01)
    optimizer = build_optimizer([model], config, ps, grads)
    norms = []
    for step in range(2):
        for sync in grads.syncs:
            sync.begin_backward(final=True)
            sync.gather_weights()
        sum((param * grad_of(name, step)).sum() for name, param in model.items()).backward()
        for sync in grads.syncs:
            sync.release_weights()
        finalize_model_grads([model], ps, grads)
        result = optimizer.step()
        assert result.ok
        norms.append(result.grad_norm)
        optimizer.zero_grad()
    with grads.whole_weights():
        for sync in grads.syncs:
            sync.wait_for_weights()
        return {name: param.detach().clone() for name, param in model.items()}, norms


def check_gradient_average(rank: int) -> None:
    ps = ParallelState.initialize(context=2)
    assert (ps.cp_size, ps.dp_size) == (2, 2)
    c, replica, share = ps.cp_size, ps.dp_rank, FRACTIONS[ps.cp_rank]
    reference, reference_norms = train_two_steps(ParallelState.single(), "no_shard", False,
                                lambda name, step: (replica_grad(name, 0, step) + replica_grad(name, 1, step)) / 2)
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        for overlap in (False, True):
            weights, norms = train_two_steps(ps, strategy, overlap,
                                             lambda name, step: c * share * replica_grad(name, replica, step))
            assert norms == pytest.approx(reference_norms, rel=1e-6), (ps.describe(), strategy, overlap)
            for name, expected in reference.items():
                torch.testing.assert_close(weights[name], expected, rtol=1e-6, atol=1e-7,
                                           msg=f"{ps.describe()} {strategy} overlap={overlap} {name}")


def optimizer_state(trainer) -> dict[str, torch.Tensor]:
    """This rank's parameters' whole master weights and Adam moments, keyed as the checkpoint keys them
    (collective: a sharded optimizer gathers them)."""
    ps, model = trainer.ps, trainer.config.model
    return {f"optimizer/{entry.key(ps, model).removeprefix('model/')}/{state}": tensor
            for entry in param_entries(trainer.engine.chunks, trainer.engine.optimizer)
            for state, tensor in {"master": entry.main, **entry.states}.items()}


def check_equal_to_file(state: dict[str, torch.Tensor], files: dict[str, torch.Tensor], what) -> None:
    """This rank's optimizer tensors equal the file's (its vocabulary padding left out)."""
    assert state and state.keys() <= files.keys(), what
    for key, tensor in state.items():
        assert torch.equal(tensor[tuple(slice(0, n) for n in files[key].shape)], files[key]), (what, key)


def check_checkpoint_across_context_sizes(rank: int, root: str, cache: str) -> None:
    flags = NO_DROPOUT + ["--use-distributed-optimizer", "--train-iters", "2"]
    trainer, _ = train(flags + ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--save", root, "--save-interval", "2"], cache)
    assert (trainer.ps.dp_cp_size, trainer.ps.dp_size) == (2, 1)  # sharded over the context ranks alone
    directory = os.path.join(root, "iter_0000002")
    _, _, files = read_checkpoint(directory)
    check_equal_to_file(optimizer_state(trainer), files, (rank, "saved at c = 2"))
    for context in (1, 4):
        loaded = {}
        train(flags + ["--context-parallel-size", str(context), "--load", directory], cache,
              after_load=lambda t: loaded.update(optimizer_state(t), layout=(t.ps.cp_size, t.ps.dp_cp_size)))
        assert loaded.pop("layout") == (context, 4)
        check_equal_to_file(loaded, files, (rank, f"loaded at c = {context}"))


def all_checks(rank: int, world_size: int, root: str, cache: str) -> str:
    check_groups(rank)
    check_gradient_average(rank)
    check_checkpoint_across_context_sizes(rank, root, cache)
    return "ok"


def test_context_groups_gradient_average_and_checkpoints_on_four_ranks(tmp_path, tmp_path_factory):
    assert run_distributed(4, all_checks, str(tmp_path), session_cache(tmp_path_factory), timeout=240) == ["ok"] * 4
