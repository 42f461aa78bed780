"""Megatron-LM checkpoints both ways, against Megatron-core itself: a GPT (LayerNorm, learned positions,
biases, tied output, Megatron-LM's fused tanh GeLU), a Llama-style model (RMSNorm, SwiGLU, RoPE,
grouped-query attention, untied output, no biases), the same with a bias on q, k and v (Qwen2's) and the
same with per-head QK layernorm and MoE layers (4 experts, top-2, a gated shared expert), MoE layers
with DeepSeek-V3's routing (sigmoid, an expert bias) and a model mixing a dense and an MoE layer
(``--moe-layer-freq``, whose torch_dist keys Megatron-core keeps one per layer) are saved by Megatron-core's ``dist_checkpointing``
(torch_dist) and as a legacy torch checkpoint of a (t, p) = (2, 2) run; each imports into megapipe with
Megatron-core's logits (fp32, 1e-5), megapipe's export loads back into Megatron-core with the very same
logits, and imports again into the very same tensors.

Megatron-core runs in a world of one spawned process (its parallel state is global, its torch_dist writer
forks), which also computes megapipe's logits of the imported checkpoints, so one process start serves all.
"""

import os

import pytest
import torch

from megatron_core_helpers import (EXPORTED, VARIANTS, build, load_dist, logits, megatron_args, megatron_core_on_cpu,
                                   save_dist, save_legacy, tokens)
from megapipe.checkpointing.common import Common, SavedLayout
from megapipe.checkpointing.convert import export_megatron_checkpoint, import_megatron_checkpoint
from megapipe.checkpointing.load import load_weights
from megapipe.checkpointing.offline import read_checkpoint
from megapipe.checkpointing.paths import find_checkpoint
from megapipe.models import build_model_chunks
from megapipe.parallel.state import ParallelState
from megapipe.testing.worlds import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]
pytest.importorskip("megatron.core")

RTOL = 1e-5
# the imported checkpoints' files are written for another layout than the one process that loads them
LAYOUTS = {"dist": SavedLayout(2, 2, 1), "torch": SavedLayout(1, 2, 1)}


def _megapipe_logits(directory: str, ids: torch.Tensor) -> torch.Tensor:
    config = Common.read(find_checkpoint(directory)).model_config
    ps = ParallelState.single()
    chunk = build_model_chunks("gpt", config, ps)[0].eval()
    load_weights(directory, "gpt", [chunk], ps, config)
    with torch.no_grad():
        return chunk(None, {"tokens": ids})[..., : config.vocab_size]


def _round_trip(rank, world_size, root):
    """Per variant: Megatron-core's logits, megapipe's of each imported format, Megatron-core's of the export."""
    out, ids = {}, tokens()
    with megatron_core_on_cpu():
        for variant in VARIANTS:
            model, args = build(variant, seed=0), megatron_args(variant)
            save_dist(model, args, os.path.join(root, f"{variant}-dist"))
            save_legacy(model, args, os.path.join(root, f"{variant}-torch"), t=2, p=2)
            result = dict(expected=logits(model, ids), megapipe={}, lines={})
            for fmt, layout in LAYOUTS.items():
                target = os.path.join(root, f"{variant}-{fmt}-megapipe")
                result["lines"][fmt] = import_megatron_checkpoint(os.path.join(root, f"{variant}-{fmt}"), target,
                                                                  layout).lines()
                result["megapipe"][fmt] = _megapipe_logits(target, ids)
            if variant not in EXPORTED:
                out[variant] = result
                continue
            exported = os.path.join(root, f"{variant}-exported")
            result["export_lines"] = export_megatron_checkpoint(os.path.join(root, f"{variant}-torch-megapipe"),
                                                                exported).lines()
            back = build(variant, seed=1)
            load_dist(back, os.path.join(exported, "iter_0000000"))
            result["exported"] = logits(back, ids)
            again = os.path.join(root, f"{variant}-exported-megapipe")
            import_megatron_checkpoint(exported, again, SavedLayout(1, 2, 1))
            result["reimported"] = [read_checkpoint(path)[1:] for path in (
                os.path.join(root, f"{variant}-torch-megapipe"), again)]
            out[variant] = result
    return out


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    return run_distributed(1, _round_trip, str(tmp_path_factory.mktemp("megatron")), timeout=240)[0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("fmt", sorted(LAYOUTS))
def test_imported_megatron_checkpoint_gives_megatron_core_logits(round_trip, variant, fmt):
    expected, actual = round_trip[variant]["expected"], round_trip[variant]["megapipe"][fmt]
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


@pytest.mark.parametrize("variant", EXPORTED)
def test_exported_checkpoint_loads_in_megatron_core_unchanged(round_trip, variant):
    assert torch.equal(round_trip[variant]["exported"], round_trip[variant]["expected"])


@pytest.mark.parametrize("variant", EXPORTED)
def test_export_then_import_gives_the_same_tensors_bit_for_bit(round_trip, variant):
    (common, tensors), (common_again, tensors_again) = round_trip[variant]["reimported"]
    assert common_again.model_config == common.model_config
    model = sorted(key for key in tensors if key.startswith("model/"))
    assert model == sorted(key for key in tensors_again if key.startswith("model/"))
    assert any(".experts." in key for key in model) == bool(common.model_config.num_experts)
    for key in model:
        assert torch.equal(tensors_again[key], tensors[key]), key


def test_conversions_say_what_they_read_and_that_the_optimizer_starts_fresh(round_trip):
    lines = round_trip["llama"]["lines"]
    assert lines["torch"][0].endswith("iter_0000010 (Megatron-LM torch, (t, p) = (2, 2), iteration 10)")
    assert lines["torch"][1].endswith("iter_0000000 ((t, p, d) = (1, 2, 1))")
    assert lines["torch"][-1].startswith("optimizer: not carried over (Megatron keeps optimizer state in its own")
    assert lines["dist"][0].endswith("iter_0000010 (Megatron-LM torch_dist, iteration 10)")
    assert not any(line.startswith("optimizer:") for line in lines["dist"])  # the save held no optimizer
    export = round_trip["llama"]["export_lines"]
    assert export[1].endswith("iter_0000000 (Megatron-LM torch_dist)")
