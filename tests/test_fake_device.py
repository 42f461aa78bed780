"""GPU readiness checked on a CPU: every model family and piece a single process holds, trained one
step through the pipeline engine on fake accelerator tensors, where a tensor made on the host by
mistake (a mask, an arange, a scale, a random state) fails as it would on a GPU."""

import pytest
import torch

from fake_device_helpers import DEVICE_MISMATCH, H, S, V, model_config, pipeline_rank, stubbed_transport
from megapipe import fusions
from megapipe.testing.fake_device import FAKE_DEVICE, DeviceMemory, fake_accelerator
from megapipe.fusions.backend import BACKENDS
from megapipe.models import MODEL_KINDS, build_model_chunks
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine

pytestmark = pytest.mark.unit

B = 2
RECOMPUTE_FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
UNFUSED = dict(bias_gelu_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False)
MOE = dict(swiglu=True, add_bias_linear=False, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
           moe_z_loss_coeff=0.001, moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=16,
           moe_shared_expert_gate=True)
CASES = {
    # every fusion backend: on a device none of their kernels runs on, each op falls back to eager
    **{f"gpt-{backend}": ("gpt", dict(backend=backend)) for backend in BACKENDS},
    "bert-eager": ("bert", {}),
    "gpt-unfused": ("gpt", dict(model=UNFUSED)),
    "bert-unfused": ("bert", dict(model=UNFUSED)),
    "gpt-rmsnorm-untied": ("gpt", dict(model=dict(normalization="RMSNorm", untie_embeddings_and_output_weights=True))),
    "bert-no-binary-head": ("bert", dict(model=dict(bert_binary_head=False))),
    "gpt-recompute-full": ("gpt", dict(model=RECOMPUTE_FULL)),
    "gpt-recompute-selective": ("gpt", dict(model=dict(recompute_granularity="selective"))),
    "bert-recompute-block": ("bert", dict(model=dict(RECOMPUTE_FULL, recompute_method="block"))),
    "gpt-bf16": ("gpt", dict(precision="bf16")),
    "gpt-fp16-loss-scaler": ("gpt", dict(precision="fp16")),
    "bert-bf16": ("bert", dict(precision="bf16")),
    # the grouped product (the loop over experts reads the per-expert counts, which a fake device cannot give)
    "gpt-moe-bf16": ("gpt", dict(precision="bf16", model=dict(MOE, moe_grouped_gemm=True))),
    "gpt-moe-capacity-bf16": ("gpt", dict(precision="bf16", model=dict(MOE, moe_grouped_gemm=True,
                                                                        moe_expert_capacity_factor=1.0))),
}


def microbatch(kind: str, device: torch.device) -> dict:
    batch = {"tokens": torch.randint(0, V, (B, S), device=device), "labels": torch.randint(0, V, (B, S), device=device),
             "loss_mask": torch.ones(B, S, device=device)}
    if kind == "bert":
        batch.update(types=torch.zeros(B, S, dtype=torch.long, device=device),
                     padding_mask=torch.ones(B, S, dtype=torch.long, device=device),
                     is_random=torch.zeros(B, dtype=torch.long, device=device))
    return batch


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_training_step_and_evaluation_run_on_the_device_only(case):
    """Forward and backward of every microbatch through the executor, the gradient finalisation,
    (un)scaling, clipping and the optimizer step, then an evaluation call: all on fake device tensors."""
    kind, options = CASES[case]
    precision = options.get("precision", "fp32")
    ps = ParallelState.single()
    with fake_accelerator() as reads, stubbed_transport():
        fusions.select_backend(options.get("backend", "eager"), FAKE_DEVICE)
        config = model_config(kind, precision, **options.get("model", {}))
        ps.seed(1234, FAKE_DEVICE)
        chunks = build_model_chunks(kind, config, ps, device=FAKE_DEVICE)
        engine = PipelineEngine(chunks, ps, OptimizerConfig(lr=1e-3, fp16=precision == "fp16",
                                                            bf16=precision == "bf16"),
                                "1f1b", 2, (S, B, H), dtype=config.params_dtype, device=FAKE_DEVICE)
        result = engine.train_batch([microbatch(kind, FAKE_DEVICE) for _ in range(2)])
        engine.evaluate([microbatch(kind, FAKE_DEVICE) for _ in range(2)])
    assert result.step is not None and reads.count > 0
    assert all(p.device == FAKE_DEVICE for chunk in chunks for p in chunk.parameters())
    # the step's outcome stays on the device for the training loop to read once per log interval
    assert result.step.skipped_flag.device == FAKE_DEVICE and result.step.norm.device == FAKE_DEVICE


@pytest.mark.parametrize("kind", sorted(MODEL_KINDS))
def test_middle_and_last_stages_run_from_a_received_hidden_state(kind):
    """The stages of a pipeline that start from the previous stage's output, not from token ids."""
    ps = ParallelState.single()
    with fake_accelerator():
        config = model_config(kind)
        for pre, post in ((False, False), (False, True)):
            stage = MODEL_KINDS[kind](config, ps, 0, 1, pre_process=pre, post_process=post, device=FAKE_DEVICE)
            hidden = torch.randn(S, B, H, device=FAKE_DEVICE, requires_grad=True)
            out = stage(hidden, microbatch(kind, FAKE_DEVICE))
            (out if post else out.sum()).backward()
            assert hidden.grad.device == FAKE_DEVICE


@pytest.mark.parametrize("kind, schedule, pipeline, virtual", [
    ("gpt", "1f1b", 3, 1), ("bert", "1f1b", 3, 1), ("gpt", "interleaved", 2, 2)])
def test_each_pipeline_rank_trains_through_the_executor_with_the_transport_stubbed(kind, schedule, pipeline, virtual):
    """Every rank of a pipeline, one at a time: its chunks' forwards and backwards in schedule order,
    receives answered with fresh device buffers, sends and collectives completing at once."""
    m = 2 * pipeline
    for rank in range(pipeline):
        ps = pipeline_rank(rank, pipeline, virtual)
        with fake_accelerator(), stubbed_transport():
            config = model_config(kind, num_layers=2 * pipeline * virtual)
            ps.seed(1234, FAKE_DEVICE)
            chunks = build_model_chunks(kind, config, ps, device=FAKE_DEVICE)
            engine = PipelineEngine(chunks, ps, OptimizerConfig(lr=1e-3), schedule, m, (S, B, H), device=FAKE_DEVICE)
            result = engine.train_batch([microbatch(kind, FAKE_DEVICE) for _ in range(m)])
            engine.evaluate([microbatch(kind, FAKE_DEVICE) for _ in range(m)])
        assert result.step.skipped_flag.device == FAKE_DEVICE
        # every chunk sends each microbatch's activation forward and its gradient back, but not
        # past the ends of the pipeline
        ends = (rank == 0) + (rank == pipeline - 1)
        assert engine.executor.p2p.messages_sent == m * (2 * virtual - ends)


class HostMask(torch.nn.Module):
    """The mistake the checks exist for: a mask made without ``device=``."""

    def forward(self, x):
        return x.masked_fill(torch.ones(x.shape, dtype=torch.bool).triu(1), 0.0)


def test_a_tensor_made_on_the_host_by_mistake_fails():
    with fake_accelerator(), pytest.raises(RuntimeError, match=DEVICE_MISMATCH):
        HostMask()(torch.randn(4, 4, device=FAKE_DEVICE))


def test_device_memory_counts_live_storages_and_the_peak():
    """A [256, 256] fp32 weight (256 KiB) and two activations of 4 KiB: exact byte counts."""
    with fake_accelerator(), DeviceMemory() as memory:
        weight = torch.empty(256, 256, device=FAKE_DEVICE)
        x = torch.empty(4, 256, device=FAKE_DEVICE)
        y = x @ weight
        assert memory.current == 4 * (256 * 256 + 2 * 4 * 256)
        del x, y
        assert memory.current == 4 * 256 * 256 and memory.peak == 4 * (256 * 256 + 2 * 4 * 256)


def _evaluation_peak_bytes(m: int) -> tuple[int, int]:
    """Peak device bytes of one evaluation call on the middle rank of a 3-stage GPT pipeline, and the
    bytes of one received boundary tensor."""
    ps = pipeline_rank(1, 3, 1)
    with fake_accelerator(), stubbed_transport():
        fusions.select_backend("eager", FAKE_DEVICE)
        config = model_config("gpt", num_layers=3)
        ps.seed(1234, FAKE_DEVICE)
        chunks = build_model_chunks("gpt", config, ps, device=FAKE_DEVICE)
        engine = PipelineEngine(chunks, ps, OptimizerConfig(lr=1e-3), "1f1b", m, (S, B, H), device=FAKE_DEVICE)
        batches = [microbatch("gpt", FAKE_DEVICE) for _ in range(m)]
        engine.evaluate(batches)  # first-call allocations (caches, lazily built state) are not the point
        memory = DeviceMemory()
        with memory:
            engine.evaluate(batches)
    return memory.peak, S * B * H * 4


def test_evaluation_memory_does_not_grow_with_its_microbatches():
    # each microbatch's received input and output are let go once its output is sent on
    (peak_few, boundary), (peak_many, _) = _evaluation_peak_bytes(3), _evaluation_peak_bytes(12)
    assert peak_few == peak_many and peak_few >= boundary
