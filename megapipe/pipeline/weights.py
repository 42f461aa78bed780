"""Weight versions of one model chunk (pipeline stage), as explicit tensors.

Version k of a stage is its weights after k updates. The module's own parameters always hold
the newest (*live*) version; older versions a schedule still needs are *stashed*. A pass runs
against an explicit version: the live parameters themselves, or alias tensors that share a
version's storage (``torch.func.functional_call``), never by loading a state dict into the
module under autograd (which broke the original PipeDream on newer PyTorch).

Copies happen only where a version differs from the live weights. A forward whose microbatch
stays in flight across an update runs on aliases of the live storage; when that update comes,
the live parameters first move to fresh storage (copy-on-write) and the aliases, with the
autograd graphs that saved them, keep the old version untouched. A stashed version is freed the
moment no in-flight microbatch uses it and no later forward will (the caller says which version
the next forward uses; ``forget_future`` when none will come).

The policies (``schedules/weight_policy.py``) bound the versions a store keeps: one for the
flush schedules, one per in-flight microbatch for PipeDream's stashing, two for 2BW.

Gradients computed on an alias are added to the live parameter's ``main_grad`` (or ``grad``),
where the next update applies them; an alias carries its parameter's ``main_grad_target``, so
with gradient-accumulation fusion the linears add their products there directly
(``tensor_parallel/grad_accumulation.py``).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import torch

from megapipe.schedules.weight_policy import WeightPolicy
from megapipe.tensor_parallel.grad_accumulation import TARGET, main_grad_target

T = TypeVar("T")


@dataclass(frozen=True)
class VersionUse:
    """What a forward ran on; hand it back with ``WeightVersionStore.backward_done``."""

    version: int
    weights: Optional[dict[str, torch.Tensor]]  # None: the module's own (live) parameters


def _accumulate_into(param: torch.Tensor, alias: torch.Tensor) -> None:
    """Post-accumulate hook of an alias: move its gradient to the live parameter it stands for."""
    sync = getattr(param, "grad_sync", None)
    if sync is not None:  # the chunk's gradient sync (``optim/grad_sync.py``) owns main_grad; alias.grad is
        sync.accumulate(param, alias.grad)  # None when the backward added its products there itself
    elif getattr(param, "main_grad", None) is not None:
        param.main_grad.add_(alias.grad)
    elif param.grad is None:
        param.grad = alias.grad.detach().clone()
    else:
        param.grad.add_(alias.grad)
    alias.grad = None


def _copy_on_write(params: list[torch.nn.Parameter]) -> None:
    """Move the live parameters to fresh storage; the stash keeps the old. Parameters that are
    views of a sharded gradient sync's weight buffer move with the whole buffer."""
    syncs = {id(sync): sync for sync in (getattr(p, "grad_sync", None) for p in params)
             if sync is not None and sync.level.shards_optimizer}
    for sync in syncs.values():
        sync.renew_weights()
    with torch.no_grad():
        for param in params:
            if id(getattr(param, "grad_sync", None)) not in syncs:
                param.data = param.detach().clone()


def _alias(param: torch.nn.Parameter, value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A leaf tensor on ``param``'s current storage (or ``value``'s), with its own autograd identity
    and version counter, whose gradient goes to ``param``."""
    source = param if value is None else value
    alias = torch.empty(0, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        alias.set_(source.untyped_storage(), source.storage_offset(), source.size(), source.stride())
    alias.requires_grad_(True)
    alias.register_post_accumulate_grad_hook(functools.partial(_accumulate_into, param))
    setattr(alias, TARGET, main_grad_target(param))
    return alias


class WeightVersionStore:
    """The weight versions of one model chunk under one policy (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, policy: WeightPolicy):
        self.module, self.policy = module, WeightPolicy(policy)
        self.params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        self.version_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        self.live_version = 0
        self._stashed: dict[int, dict[str, torch.Tensor]] = {}
        self._live_aliases: Optional[dict[str, torch.Tensor]] = None
        self._pinned: set[int] = set()
        self._in_flight: Counter = Counter()  # forwards on aliases not yet backwarded, per version
        self._on_live_params = 0  # forwards on the live parameters not yet backwarded
        self._replaying = False  # restoring a checkpoint's in-flight forwards: release nothing yet
        self.peak_versions = 1

    # ---- what tests and logs read -------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        """Every version held, oldest first (the live one last)."""
        return sorted(self._stashed) + [self.live_version]

    @property
    def num_versions(self) -> int:
        return len(self._stashed) + 1

    @property
    def bytes_held(self) -> int:
        return self.num_versions * self.version_bytes

    @property
    def peak_bytes(self) -> int:
        return self.peak_versions * self.version_bytes

    # ---- passes ---------------------------------------------------------------------------------
    def forward(self, version: Optional[int] = None, survives_update: bool = False) -> VersionUse:
        """The weights a forward on ``version`` (None: live) runs on.

        ``survives_update``: an update of this stage comes before the microbatch's backward, so
        the forward must not run on the live parameters themselves.
        """
        version = self.live_version if version is None else version
        if version > self.live_version:
            raise RuntimeError(f"weight version {version} does not exist yet; the stage is at {self.live_version}")
        if self.policy is WeightPolicy.SINGLE and (version != self.live_version or survives_update):
            raise RuntimeError("the single weight policy keeps one version, but a forward asked for an older one or "
                               "to outlive an update; flush schedules update only after every backward")
        self._pinned = {v for v in self._pinned if v >= version}  # forwards never go back to older versions
        if version == self.live_version and not survives_update:
            self._on_live_params += 1
            return VersionUse(version, None)
        if version == self.live_version:
            if self._live_aliases is None:
                self._live_aliases = {name: _alias(p) for name, p in self.params.items()}
            weights = self._live_aliases
        elif version in self._stashed:
            weights = self._stashed[version]
        else:
            raise RuntimeError(f"weight version {version} was released; a schedule must pin a version that later "
                               "forwards use when it updates past it")
        self._in_flight[version] += 1
        self._release()
        return VersionUse(version, weights)

    def backward_done(self, use: VersionUse) -> None:
        """The microbatch that ran on ``use`` finished its backward; its version may be freed."""
        if use.weights is None:
            self._on_live_params -= 1
        else:
            self._in_flight[use.version] -= 1
        self._release()

    def update(self, step: Callable[[], T], next_forward_version: Optional[int] = None) -> T:
        """Run ``step`` (an in-place update of the live parameters), creating the next version.

        ``next_forward_version``: the version the stage's next forward will use (None: no
        forward comes). Later forwards never use older ones, so older stashed versions go as
        soon as their in-flight microbatches are done; if it is the live one, that is stashed.
        """
        if self._on_live_params:
            raise RuntimeError("an update came while a microbatch that ran on the live parameters is in flight; "
                               "its forward should have been told that it survives an update")
        if next_forward_version is None:
            self._pinned.clear()
        else:
            self._pinned = {v for v in self._pinned if v >= next_forward_version}
            if next_forward_version <= self.live_version:
                self._pinned.add(self.live_version)
        if self.live_version in self._pinned or self._in_flight[self.live_version]:
            self._stashed[self.live_version] = self._live_aliases or {n: _alias(p) for n, p in self.params.items()}
            _copy_on_write(list(self.params.values()))
        self._live_aliases = None
        result = step()
        self.live_version += 1
        self._release()
        most = self.policy.most_versions
        if most is not None and self.num_versions > most:
            raise RuntimeError(f"the {self.policy.value} weight policy keeps at most {most} versions, but this stage "
                               f"now holds {self.versions}")
        self.peak_versions = max(self.peak_versions, self.num_versions)
        return result

    def forget_future(self) -> None:
        """No later forward will come (the pipeline drains): unpin every version."""
        self._pinned.clear()
        self._release()

    # ---- checkpoints ----------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """What a checkpoint needs to rebuild this store between two calls of a schedule: the live
        version's number, the stashed versions (their values) and the pinned version numbers.
        The in-flight counts come back when the in-flight forwards are replayed."""
        return dict(live_version=self.live_version, pinned=sorted(self._pinned),
                    stashed={version: {name: t.detach() for name, t in weights.items()}
                             for version, weights in self._stashed.items()})

    def start_replay(self, state: dict) -> None:
        """Take back ``checkpoint_state``'s versions (the live values are the module's, loaded
        with the model); then replay the in-flight forwards and call ``finish_replay``."""
        if self._stashed or self._in_flight or self._on_live_params:
            raise RuntimeError("a weight store can take back a checkpoint's versions only while nothing is in flight")
        self.live_version, self._pinned = state["live_version"], set(state["pinned"])
        self._stashed = {version: {name: _alias(self.params[name], value.clone()) for name, value in weights.items()}
                         for version, weights in state["stashed"].items()}
        self._replaying = True

    def finish_replay(self) -> None:
        self._replaying = False
        self._release()
        self.peak_versions = max(self.peak_versions, self.num_versions)

    def _release(self) -> None:
        if self._replaying:
            return
        for version in [v for v in self._stashed if v not in self._pinned and not self._in_flight[v]]:
            del self._stashed[version]
