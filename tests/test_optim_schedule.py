"""Learning-rate schedule against closed forms, and OptimizerConfig validation messages."""

import math

import pytest
import torch

from megapipe.errors import CheckpointError, ConfigError
from megapipe.optim import LRSchedule, LRScheduler, OptimizerConfig

pytestmark = pytest.mark.unit

MAX_LR, MIN_LR, WARMUP, DECAY = 3e-4, 3e-5, 10, 100


def expected_lr(style: str, i: int) -> float:
    """Megatron's schedule written out per style: linear warm-up from 0, decay to MIN_LR, then flat."""
    if i <= WARMUP:
        return MAX_LR * i / WARMUP
    if style == "constant":
        return MAX_LR
    if i > DECAY:
        return MIN_LR
    if style == "inverse-square-root":
        return max(MIN_LR, MAX_LR * (WARMUP / i) ** 0.5)
    fraction_done = (i - WARMUP) / (DECAY - WARMUP)
    shape = {"linear": 1 - fraction_done, "cosine": (1 + math.cos(math.pi * fraction_done)) / 2}[style]
    return MIN_LR + (MAX_LR - MIN_LR) * shape


def config(style: str, **overrides) -> OptimizerConfig:
    fields = dict(lr=MAX_LR, min_lr=MIN_LR, lr_decay_style=style, lr_warmup_iters=WARMUP, lr_decay_iters=DECAY)
    fields.update(overrides)
    cfg = OptimizerConfig(**fields)
    cfg.validate()
    return cfg


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_schedule_matches_closed_form_and_sets_every_group(style):
    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1.0)
    scheduler = LRScheduler(optimizer, config(style), train_iters=500)
    for i in range(130):
        # float64 arithmetic on both sides, written differently: agreement to 1e-12 relative.
        assert scheduler.lr == pytest.approx(expected_lr(style, i), rel=1e-12, abs=0.0), (style, i)
        assert [g["lr"] for g in optimizer.param_groups] == [scheduler.lr] * 2
        scheduler.step()


def test_schedule_landmarks():
    lr = {style: LRSchedule.from_config(config(style), 500).lr_at for style in
          ("linear", "cosine", "inverse-square-root", "constant")}
    assert lr["linear"](0) == 0.0 and lr["linear"](5) == pytest.approx(MAX_LR / 2, rel=1e-12)
    assert lr["linear"](WARMUP) == MAX_LR and lr["cosine"](WARMUP) == MAX_LR
    assert lr["linear"](55) == pytest.approx((MAX_LR + MIN_LR) / 2, rel=1e-12)
    assert lr["cosine"](55) == pytest.approx((MAX_LR + MIN_LR) / 2, rel=1e-12)
    assert lr["cosine"](DECAY) == pytest.approx(MIN_LR, rel=1e-12) and lr["cosine"](DECAY + 1) == MIN_LR
    assert lr["inverse-square-root"](40) == pytest.approx(MAX_LR / 2, rel=1e-12)
    assert lr["constant"](10_000) == MAX_LR


def test_warmup_fraction_and_decay_default_to_train_iters():
    by_fraction = LRSchedule.from_config(config("cosine", lr_warmup_iters=0, lr_warmup_fraction=0.1,
                                                lr_decay_iters=None), train_iters=DECAY)
    assert by_fraction.warmup_iters == WARMUP and by_fraction.decay_iters == DECAY
    reference = LRSchedule.from_config(config("cosine"), train_iters=999)
    assert [by_fraction.lr_at(i) for i in range(120)] == pytest.approx([reference.lr_at(i) for i in range(120)],
                                                                        rel=1e-12)


def test_no_warmup_starts_at_peak():
    schedule = LRSchedule.from_config(config("linear", lr_warmup_iters=0), 500)
    assert schedule.lr_at(0) == MAX_LR and schedule.lr_at(DECAY) == pytest.approx(MIN_LR, rel=1e-12)


def test_scheduler_state_dict_resumes_and_rejects_changed_flags():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    first = LRScheduler(optimizer, config("cosine"), 500)
    first.step(37)
    resumed = LRScheduler(optimizer, config("cosine"), 500)
    resumed.load_state_dict(first.state_dict())
    assert resumed.iteration == 37 and optimizer.param_groups[0]["lr"] == first.lr
    with pytest.raises(CheckpointError, match=r"\(--lr 0.0003 -> 0.001; .* to follow the flags' schedule, add "
                                              r"--override-opt-param-scheduler; .* resume with --lr 0.0003 or add"):
        LRScheduler(optimizer, config("cosine", lr=1e-3), 500).load_state_dict(first.state_dict())


def test_warmup_must_end_before_decay():
    with pytest.raises(ConfigError, match="--lr-decay-iters 100"):
        LRSchedule.from_config(config("linear", lr_warmup_iters=100), 500)


@pytest.mark.parametrize("fields, flag", [
    (dict(fp16=True, bf16=True), "--fp16 and --bf16"),
    (dict(lr_warmup_iters=5, lr_warmup_fraction=0.1), "--lr-warmup-iters and --lr-warmup-fraction"),
    (dict(optimizer="lamb"), "--optimizer lamb"),
    (dict(lr=None), "--lr"),
    (dict(min_lr=1.0), "--min-lr 1.0"),
    (dict(lr_decay_style="step"), "--lr-decay-style step"),
    (dict(loss_scale=128.0), "--loss-scale 128.0"),
    (dict(fp16=True, min_loss_scale=2.0 ** 40), "--min-loss-scale"),
    (dict(hysteresis=0), "--hysteresis 0"),
    (dict(clip_grad=-1.0), "--clip-grad -1.0"),
    (dict(lr_warmup_fraction=1.5), "--lr-warmup-fraction 1.5"),
])
def test_config_errors_are_one_sentence_naming_the_flag(fields, flag):
    cfg = OptimizerConfig(**{"lr": 1e-4, **fields})
    with pytest.raises(ConfigError) as error:
        cfg.validate()
    message = str(error.value)
    assert flag in message
    assert message.endswith(".") and message.count(". ") == 0, message


def test_default_config_is_valid():
    OptimizerConfig(lr=1e-4).validate()
    OptimizerConfig(lr=1e-4, fp16=True, loss_scale=1024.0).validate()
