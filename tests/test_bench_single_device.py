"""``benchmarks/bench_single_device.py``'s rows as the GPU acceptance reads them: FP8 against bf16 (speed and
the loss after the same steps), rows the device cannot run left out with megapipe's sentence, ``--only``,
and the aims the acceptance step notes from them."""

import pytest
import torch

from megapipe.acceptance import benchmark as acceptance
from megapipe.acceptance.record import Record, read_checks

pytestmark = pytest.mark.unit

def _result(bench, system, seconds: float, loss: float):
    return bench.Result(system, [seconds, seconds], [0.9 * seconds, 0.9 * seconds], final_loss=loss)


def test_an_fp8_row_gives_its_speed_and_loss_against_the_bf16_row(bench):
    shape, cpu = bench.SHAPES["cpu-small"], torch.device("cpu")
    bf16 = bench.Megapipe("megapipe", shape, cpu, 0.1)
    fp8 = bench.Megapipe("megapipe, FP8 hybrid tensorwise", shape, cpu, 0.1, fp8=("hybrid", "tensorwise"))
    hf = bench.HuggingFace(shape, cpu, 0.1, "autocast")
    rows = bench.table_rows([_result(bench, bf16, 2.0, 5.0), _result(bench, hf, 4.0, 5.1),
                             _result(bench, fp8, 1.6, 5.02)], shape, 2, 1e12, 100.0)
    by_name = {row["system"]: row for row in rows}
    assert by_name["megapipe, FP8 hybrid tensorwise"]["vs_bf16"] == pytest.approx(2.0 / 1.6)
    assert by_name["megapipe, FP8 hybrid tensorwise"]["loss_vs_bf16"] == pytest.approx(0.02 / 5.0)
    assert by_name["megapipe, FP8 hybrid tensorwise"]["precision"].startswith("FP8 hybrid tensorwise")
    assert "loss_vs_bf16" not in by_name["megapipe"] and by_name["megapipe"]["vs_hf"] == pytest.approx(2.0)


def test_a_row_the_cpu_cannot_run_is_left_out_with_megapipes_sentence(bench):
    shape, cpu = bench.SHAPES["cpu-small"], torch.device("cpu")
    fp8 = bench.Megapipe("megapipe, FP8 e4m3 tensorwise", shape, cpu, 0.1, fp8=("e4m3", "tensorwise"))

    class Args:
        warmup, micro_batches = 1, 2

    result = bench.build_and_warm(fp8, [], Args, cpu)
    assert result.error is None and "needs a GPU with FP8 matrix units" in result.left_out
    [row] = bench.table_rows([result], shape, 2, 1e12, 100.0)
    assert row == {"system": fp8.name, "left_out": result.left_out}
    assert acceptance._ran(row) == f"left out: {result.left_out}"
    with pytest.raises(AssertionError, match="out of memory"):
        acceptance._ran({"system": "megapipe", "error": "out of memory"})


def test_the_fp8_rows_keep_the_runs_fp8_choice_and_fusion_backend_unchanged(bench):
    """A row's FP8 recipe and fusion backend are active only while it builds and runs."""
    from megapipe.fusions import active_backend, fp8, fp8_mode

    shape, cpu = bench.Shape(1, 32, 2, 16, 2, vocab_size=64), torch.device("cpu")
    before = active_backend()
    with fp8.emulated():
        system = bench.Megapipe("megapipe, FP8 e4m3 tensorwise", shape, cpu, 0.0, fp8=("e4m3", "tensorwise"))
        system.build()
        assert fp8_mode.active_fp8() is None and active_backend() is before
        batch = bench.make_batch(shape, cpu, seed=0)
        seen = []
        original = system.model.forward

        def forward(*args, **kwargs):
            seen.append(fp8_mode.active_fp8())
            return original(*args, **kwargs)

        system.model.forward = forward
        assert torch.isfinite(system.forward_backward(batch, 1))
    assert [str(recipe) for recipe in seen] == [str(system.recipe)] and system.recipe is not None
    assert fp8_mode.active_fp8() is None and active_backend() is before


def test_only_picks_the_bf16_row_by_its_name_and_others_by_a_word(bench):
    words = ["megapipe", "FP8"]
    assert bench.chosen("megapipe", words) and bench.chosen("megapipe, FP8 e4m3 tensorwise", words)
    assert not bench.chosen("megapipe, full recompute", words)
    assert not bench.chosen("Hugging Face GPT2LMHeadModel", words)


def test_the_acceptance_notes_each_aim_from_the_rows(tmp_path):
    report = {"shapes": {
        "gpt-1.3b": [{"system": "megapipe", "mfu": 0.56, "mfu_passes": 0.57, "vs_hf": 2.1},
                     {"system": "megapipe, FP8 e4m3 tensorwise", "vs_bf16": 1.2, "loss_vs_bf16": 0.004}],
        "gpt-350m": [{"system": "megapipe", "mfu": 0.44, "mfu_passes": 0.45, "vs_hf": 2.0}]}}
    record = Record(str(tmp_path / "checks.jsonl"))
    acceptance._note_aims(record, report)
    checks = {check.name: check for check in read_checks(record.path)}
    assert {check.outcome for check in checks.values()} == {"noted"}
    details = [check.detail for check in checks.values()]
    assert details[0].startswith("met: 56.0% MFU") and details[1].startswith("not met: 44.0%")
    assert details[2] == "not met: 1.20x, loss after the same steps +0.40% from bf16's"
