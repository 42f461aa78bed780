"""Gradient finalisation, global norm, clipping and overflow skips on 4 real gloo processes.

One spawned world builds three layouts (t2 x p2, t2 x d2, p2 x d2) and runs every check; each
rank computes the unsplit reference itself from the same seeds, so a failing assert names the
rank and layout.
"""

import math

import torch

from megapipe.optim import GradBuffers, OptimizerConfig, build_optimizer, finalize_model_grads
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.utils import mark_tensor_parallel, shard
from megapipe.testing.worlds import run_distributed

# The unsplit model: name -> (shape, how it is split, which pipeline stage holds it).
FULL_MODEL = {
    "embedding": ((8, 4), 0, "both"),  # vocab-parallel, tied between the first and the last stage
    "w1": ((6, 4), 0, 0),  # column-parallel
    "b1": ((4,), None, 0),  # replicated
    "w2": ((4, 6), 1, 1),  # row-parallel
    "norm": ((4,), None, 1),  # replicated, sequence parallel
}


def full_grads() -> dict[str, torch.Tensor]:
    """The whole model's gradient, the same on every rank; a few exact zeros for the zero count."""
    generator = torch.Generator().manual_seed(11)
    grads = {name: torch.randn(shape, generator=generator) for name, (shape, _, _) in FULL_MODEL.items()}
    grads["w1"][0] = 0.0
    grads["embedding"][3] = 0.0
    return grads


def stage_model(ps: ParallelState, dtype=torch.float32) -> tuple[torch.nn.ParameterDict, dict[str, int]]:
    """This rank's shards of FULL_MODEL (zero-initialised), marked as the model code marks them.

    With one pipeline stage the rank holds every parameter and the embedding is not marked tied."""
    params = torch.nn.ParameterDict()
    for name, (shape, split, stage) in FULL_MODEL.items():
        if stage not in ("both", ps.pp_rank) and ps.pp_size > 1:
            continue
        local = list(shape)
        if split is not None:
            local[split] //= ps.tp_size
        param = torch.nn.Parameter(torch.zeros(local, dtype=dtype))
        if split is not None:
            mark_tensor_parallel(param, split)
        if name == "embedding" and ps.pp_size > 1:
            param.tied_embedding = ps.is_first_stage
            param.shared_embedding = ps.is_last_stage
        if name == "norm":
            param.sequence_parallel = True
        params[name] = param
    return params, {name: split for name, (_, split, _) in FULL_MODEL.items()}


def local_grad(ps: ParallelState, full: torch.Tensor, split) -> torch.Tensor:
    return full if split is None else shard(full, split, ps.tp_rank, ps.tp_size)


def check_norm_clip_and_zero_count(ps: ParallelState) -> None:
    full = full_grads()
    norm = math.sqrt(sum(g.double().square().sum().item() for g in full.values()))
    zeros = sum(int((g == 0).sum()) for g in full.values())
    clip = norm / 4
    cfg = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=clip,
                          log_num_zeros_in_grad=True)
    model, splits = stage_model(ps)
    grads = GradBuffers([model], ps)
    opt = build_optimizer([model], cfg, ps, grads)
    for name, param in model.items():  # the gradients as they stand after finalize_model_grads
        param.main_grad.copy_(local_grad(ps, full[name], splits[name]))
    result = opt.step()
    assert result.ok and result.num_zeros == zeros == 8, (ps.describe(), result)
    # fp32 partial sums of ~150 squares, then one all-reduce: well inside 1e-6 relative of float64.
    assert math.isclose(result.grad_norm, norm, rel_tol=1e-6), (ps.describe(), result.grad_norm, norm)
    coefficient = clip / (norm + 1e-6)
    for name, param in model.items():  # params started at 0, so SGD with lr 1 leaves -clipped grad
        expected = -local_grad(ps, full[name], splits[name]).double() * coefficient
        torch.testing.assert_close(param.detach().double(), expected, rtol=1e-6, atol=0.0)


def coefficient_grid(ps: ParallelState, name: str, shape, microbatch: int, t: int, d: int, p: int) -> torch.Tensor:
    """The gradient rank (t, d, p) produces for ``name`` in one microbatch: small dyadic numbers, so
    sums and halves are exact and the reference can be compared with equality."""
    base = torch.arange(math.prod(shape), dtype=torch.float32).view(shape) / 4
    return base + 16 * t + 64 * d + 256 * p + 1024 * microbatch + 4096 * len(name)


def backward_two_microbatches(ps: ParallelState, model: torch.nn.ParameterDict) -> None:
    """Produce the coefficient grids as real gradients, through autograd and the accumulation hook."""
    for microbatch in range(2):
        loss = sum((param * coefficient_grid(ps, name, param.shape, microbatch, ps.tp_rank, ps.dp_rank,
                                             ps.pp_rank)).sum() for name, param in model.items())
        loss.backward()


def expected_local_grad(ps: ParallelState, name: str, shape, over_tensor: bool, over_stages: bool) -> torch.Tensor:
    """Average over d of the two-microbatch sums, summed over t and/or the two stages if asked."""
    tensor_ranks = range(ps.tp_size) if over_tensor else [ps.tp_rank]
    stages = range(ps.pp_size) if over_stages else [ps.pp_rank]
    total = sum(coefficient_grid(ps, name, shape, m, t, d, p)
                for m in range(2) for t in tensor_ranks for d in range(ps.dp_size) for p in stages)
    return total / ps.dp_size


def check_finalize_data_and_sequence_parallel(ps: ParallelState) -> None:
    """t2 x d2: DP average of everything, tensor-group sum of the sequence-parallel norm."""
    model, _ = stage_model(ps)
    grads = GradBuffers([model], ps, bucket_size=5)  # several buckets, several collectives
    assert len(grads.buckets) > 1
    backward_two_microbatches(ps, model)
    grads.start_data_parallel_reduce()  # overlapped start; finalize waits for it
    finalize_model_grads([model], ps, grads)
    grads.finish_data_parallel_reduce()  # a second wait must not average again
    for name, param in model.items():
        expected = expected_local_grad(ps, name, param.shape, over_tensor=(name == "norm"), over_stages=False)
        assert torch.equal(param.main_grad, expected), (ps.describe(), name)


def check_finalize_tied_embedding(ps: ParallelState) -> None:
    """p2 x d2: DP average, then the embedding's two copies each hold the sum of both stages."""
    model, _ = stage_model(ps)
    grads = GradBuffers([model], ps)
    backward_two_microbatches(ps, model)
    finalize_model_grads([model], ps, grads)
    for name, param in model.items():
        expected = expected_local_grad(ps, name, param.shape, over_tensor=False, over_stages=(name == "embedding"))
        assert torch.equal(param.main_grad, expected), (ps.describe(), name)


def check_overflow_on_one_rank_skips_everywhere(ps: ParallelState, dtype, loss_scaling: bool) -> None:
    cfg = OptimizerConfig(lr=0.1, fp16=loss_scaling, bf16=not loss_scaling, initial_loss_scale=8.0, hysteresis=1)
    model, _ = stage_model(ps, dtype)
    grads = GradBuffers([model], ps)
    opt = build_optimizer([model], cfg, ps, grads)
    for bad_rank in (3, None):
        grads.buffer.fill_(1.0)
        if ps.rank == bad_rank:
            grads.buffer[-1] = float("inf")
        before = [p.detach().clone() for p in model.values()]
        result = opt.step()
        opt.zero_grad()
        changed = [not torch.equal(b, p) for b, p in zip(before, model.values())]
        assert result.ok == (bad_rank is None), (ps.describe(), bad_rank, result)
        assert all(changed) if result.ok else not any(changed), (ps.describe(), changed)
    if loss_scaling:
        assert opt.loss_scale == 4.0, opt.loss_scale  # halved once (hysteresis 1), on every rank


def all_checks(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    tensor_pipeline = ParallelState.initialize(tensor=2, pipeline=2)
    tensor_data = ParallelState.initialize(tensor=2, pipeline=1)
    pipeline_data = ParallelState.initialize(tensor=1, pipeline=2)
    check_norm_clip_and_zero_count(tensor_pipeline)
    check_finalize_data_and_sequence_parallel(tensor_data)
    check_finalize_tied_embedding(pipeline_data)
    check_overflow_on_one_rank_skips_everywhere(tensor_pipeline, torch.float16, loss_scaling=True)
    check_overflow_on_one_rank_skips_everywhere(tensor_pipeline, torch.bfloat16, loss_scaling=False)
    return "ok"


def test_optimizer_collectives_on_four_ranks():
    assert run_distributed(4, all_checks, timeout=120) == ["ok"] * 4
