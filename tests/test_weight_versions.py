"""The weight version store on its own: passes on explicit versions, copy-on-write updates,
versions released when nothing needs them, the counts and bytes it reports, its policies."""

import pytest
import torch
from torch.func import functional_call

from megapipe.schedules.weight_policy import WeightPolicy
from megapipe.pipeline.weights import WeightVersionStore

pytestmark = pytest.mark.unit

BYTES = 6 * 4  # a 2x3 fp32 weight


def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2, bias=False)


def loss_on(module, use, x):
    out = module(x) if use.weights is None else functional_call(module, use.weights, (x,))
    return (out ** 2).sum()  # its gradients depend on the weights, so a wrong version shows


def sgd_step(module, lr=0.5):
    def step():
        with torch.no_grad():
            module.weight -= lr * module.weight.grad  # in place, as every optimizer does
        module.weight.grad = None
    return step


def test_a_backward_after_an_update_uses_its_forwards_version():
    module = linear()
    store = WeightVersionStore(module, WeightPolicy.STASH)
    x = torch.randn(4, 3, requires_grad=True)
    w0 = module.weight.detach().clone()
    first = store.forward(0, survives_update=True)
    pending = loss_on(module, first, x)
    module.weight.grad = torch.ones_like(w0)
    store.update(sgd_step(module), next_forward_version=1)  # W1 = W0 - 0.5
    assert torch.equal(module.weight, w0 - 0.5) and store.versions == [0, 1]
    pending.backward()  # through the graph saved on version 0
    reference_x = x.detach().clone().requires_grad_(True)
    reference_w = w0.clone().requires_grad_(True)
    ((reference_x @ reference_w.T) ** 2).sum().backward()
    torch.testing.assert_close(module.weight.grad, reference_w.grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=0, atol=0)
    store.backward_done(first)
    assert store.versions == [1] and store.bytes_held == BYTES


def test_forward_on_the_live_parameters_must_not_outlive_an_update():
    module = linear()
    store = WeightVersionStore(module, WeightPolicy.STASH)
    store.forward(0, survives_update=False)
    with pytest.raises(RuntimeError, match="should have been told that it survives an update"):
        store.update(lambda: None, next_forward_version=1)


def test_pipedream_stage_holds_one_version_per_microbatch_in_flight():
    # Stage 0 of a 3-stage PipeDream pipeline: 3 warm-up forwards, then F / B + update. It holds
    # p - s = 3 versions at most, and copies only when an update must keep the live version.
    module = linear()
    store = WeightVersionStore(module, WeightPolicy.STASH)
    x = torch.randn(2, 3)
    in_flight = {}
    for k in range(3):
        in_flight[k] = (store.forward(0, survives_update=True), None)
    assert store.versions == [0] and store.bytes_held == BYTES  # three forwards share the live weights
    for k in range(3, 9):
        use, _ = in_flight.pop(k - 3)
        loss_on(module, use, x).backward()
        store.backward_done(use)
        store.update(sgd_step(module), next_forward_version=k - 2)
        in_flight[k] = (store.forward(k - 2, survives_update=True), None)
        assert len(store.versions) <= 3
    assert store.peak_versions == 3 and store.peak_bytes == 3 * BYTES
    store.forget_future()
    for use, _ in in_flight.values():
        store.backward_done(use)
    assert store.versions == [6]


def test_double_buffer_keeps_two_versions_and_refuses_a_third():
    # The last stage of 2BW with m = 2: batch 1 still uses version 0 after the first update.
    module = linear()
    store = WeightVersionStore(module, WeightPolicy.DOUBLE_BUFFER)
    x = torch.randn(2, 3)
    for version, next_version in [(0, 0), (0, 1), (1, 2)]:
        for _ in range(2):
            use = store.forward(version)
            loss_on(module, use, x).backward()
            store.backward_done(use)
        store.update(sgd_step(module), next_forward_version=next_version)
        assert len(store.versions) == 2
    assert store.versions == [2, 3]
    store.forward(2)  # a microbatch on the stashed version in flight, while the next forward needs version 3:
    module.weight.grad = torch.zeros_like(module.weight)
    with pytest.raises(RuntimeError, match="at most 2 versions"):
        store.update(sgd_step(module), next_forward_version=3)


def test_alias_gradients_reach_main_grad():
    module = linear()
    module.weight.main_grad = torch.zeros_like(module.weight)
    store = WeightVersionStore(module, WeightPolicy.STASH)
    use = store.forward(0, survives_update=True)
    loss_on(module, use, torch.ones(1, 3)).backward()
    assert module.weight.grad is None and module.weight.main_grad.abs().sum() > 0


def test_single_policy_keeps_one_version():
    store = WeightVersionStore(linear(), WeightPolicy.SINGLE)
    with pytest.raises(RuntimeError, match="single weight policy keeps one version"):
        store.forward(0, survives_update=True)
