"""Random streams for dropout under tensor parallelism.

Dropout on activations that every tensor rank holds in full (the residual stream) must draw
the same mask on every tensor rank: it uses the default generator, seeded identically across
the tensor group. Dropout inside a tensor-parallel region (attention probabilities of the
local heads) and on sequence-parallel slices must differ across tensor ranks: it runs inside
``tracker.fork()``, a separate stream seeded per tensor rank (Megatron's offset of 2718).
"""

from __future__ import annotations

import contextlib

import torch

from megapipe.parallel.launch import manual_seed, rng_state, set_rng_state

MODEL_PARALLEL_SEED_OFFSET = 2718
PIPELINE_SEED_STRIDE = 100


class RNGTracker:
    """Named generator states that can be swapped in for the default generator of a device."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        saved = rng_state(self.device)
        manual_seed(seed, self.device)
        self.states[name] = rng_state(self.device)
        set_rng_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel"):
        """Run the block with the named stream, then restore the default one."""
        if name not in self.states:
            raise RuntimeError(f"random stream '{name}' was never seeded; call seed_parallel_rng first")
        saved = rng_state(self.device)
        set_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = rng_state(self.device)
            set_rng_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        """The streams' states; each is a fresh host tensor that is replaced, never written in place,
        so a snapshot needs no copy (and makes no device work)."""
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)


def seed_parallel_rng(seed: int, tp_rank: int, pp_rank: int, device: torch.device) -> RNGTracker:
    """Seed the default generator (same across tensor ranks, distinct per stage) and the tracker."""
    base = seed + PIPELINE_SEED_STRIDE * pp_rank
    torch.manual_seed(base)
    manual_seed(base, device)
    tracker = RNGTracker(device)
    tracker.add("model-parallel", base + MODEL_PARALLEL_SEED_OFFSET + tp_rank)
    return tracker


def capture_rng(tracker: "RNGTracker | None", device: torch.device) -> dict[str, torch.Tensor]:
    """Every random state dropout on ``device`` draws from: the CPU and device generators and the
    tracker's streams, as ``{"cpu", "device", "tracker/<stream>"}`` (no "device" on a CPU)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        states["device"] = rng_state(device).cpu()
    if tracker is not None:
        states.update({f"tracker/{name}": state for name, state in tracker.get_states().items()})
    return states


def restore_rng(states: dict[str, torch.Tensor], tracker: "RNGTracker | None", device: torch.device) -> None:
    """Put back what ``capture_rng`` returned."""
    torch.set_rng_state(states["cpu"])
    if "device" in states:
        set_rng_state(states["device"], device)
    streams = {name.removeprefix("tracker/"): state for name, state in states.items() if name.startswith("tracker/")}
    if streams:
        tracker.set_states(streams)
