"""What an asynchronous pipeline (PipeDream, 2BW) holds between two calls, as checkpoint tensors.

Such a pipeline never empties while it trains: between calls a rank holds forwards whose
backwards are still to come (each with its autograd graph), the weight versions they ran on,
tensors handed between its own chunks, and gradients accumulated towards the next update. A
checkpoint that drained the pipeline instead would apply those updates early and change the
trajectory, so ``InFlight`` records instead what rebuilds that state exactly:

* the executor's position (calls run, version numbering base) and each weight store's live
  version number, pinned version numbers and stashed versions (their values);
* per in-flight forward, in the order it ran: stage, microbatch, the version and whether it
  ran on an alias (it outlives an update), its input (boundary tensor), its data and the
  random states before it ran; replaying these forwards rebuilds the graphs bit for bit;
* tensors waiting on this rank: outputs for its own next chunk, gradients for its own
  previous chunk, and messages already received for a later call (``PipelineExecutor.in_flight``
  receives early every message sent before the checkpoint, so none is in transit);
* the gradient buffers (2BW accumulates m microbatches between updates).

Everything is per rank and fits only the same layout, schedule and batch sizes.
``to_tensors`` flattens it into ``{name: tensor}`` plus a JSON description (stored as a byte
tensor), so the checkpoint keeps it next to the rank's random states.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import torch

from megapipe.data.context_batch import HOST_FIELDS

META = "meta"


@dataclass
class ForwardRecord:
    """A forward whose backward is still to come, as replaying it needs it."""

    stage: int
    microbatch: int
    version: Optional[int]  # None: the schedule keeps one weight version (no store)
    on_alias: bool  # ran on an alias of its version (outlives an update), not the live parameters
    inp: Optional[torch.Tensor]  # the boundary tensor it received; None on the first stage
    batch: dict[str, torch.Tensor]  # the microbatch's data
    rng: dict[str, torch.Tensor]  # random states before it ran (``capture_rng``)


@dataclass
class InFlight:
    """One rank's asynchronous pipeline between two calls (see the module docstring)."""

    calls: int
    base_versions: list[int]
    stores: list[dict]  # WeightVersionStore.checkpoint_state() per chunk
    forwards: list[ForwardRecord]
    local_outputs: dict[tuple[int, int], torch.Tensor]
    local_grads: dict[tuple[int, int], torch.Tensor]
    prereceived: dict[tuple[str, int, int], torch.Tensor]  # (RECV kind value, stage, microbatch)
    grads: list[torch.Tensor] = field(default_factory=list)  # gradient buffer of each optimizer group

    # ---- checkpoint form ----------------------------------------------------------------------
    def to_tensors(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        stores = []
        for c, store in enumerate(self.stores):
            for version, weights in store["stashed"].items():
                tensors.update({f"store/{c}/{version}/{name}": t for name, t in weights.items()})
            stores.append(dict(live_version=store["live_version"], pinned=store["pinned"],
                               stashed={version: sorted(weights) for version, weights in store["stashed"].items()}))
        forwards = []
        for k, record in enumerate(self.forwards):
            if record.inp is not None:
                tensors[f"forward/{k}/inp"] = record.inp
            tensors.update({f"forward/{k}/batch/{name}": t for name, t in record.batch.items()})
            tensors.update({f"forward/{k}/rng/{name}": t for name, t in record.rng.items()})
            forwards.append(dict(stage=record.stage, microbatch=record.microbatch, version=record.version,
                                 on_alias=record.on_alias, inp=record.inp is not None, batch=sorted(record.batch),
                                 rng=sorted(record.rng)))
        waiting = {}
        for kind, held in (("local_outputs", self.local_outputs), ("local_grads", self.local_grads),
                           ("prereceived", self.prereceived)):
            waiting[kind] = [list(key) for key in held]
            tensors.update({f"{kind}/{'.'.join(map(str, key))}": t for key, t in held.items()})
        tensors.update({f"grads/{g}": t for g, t in enumerate(self.grads)})
        meta = dict(calls=self.calls, base_versions=self.base_versions, stores=stores, forwards=forwards,
                    grads=len(self.grads), **waiting)
        tensors[META] = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        return {name: t.detach() for name, t in tensors.items()}

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor], device: torch.device) -> "InFlight":
        meta = json.loads(bytes(tensors[META].tolist()).decode())

        def get(name: str) -> torch.Tensor:
            return tensors[name].to(device)

        stores = [dict(live_version=store["live_version"], pinned=store["pinned"],
                       stashed={int(version): {name: get(f"store/{c}/{version}/{name}") for name in names}
                                for version, names in store["stashed"].items()})
                  for c, store in enumerate(meta["stores"])]
        forwards = [ForwardRecord(f["stage"], f["microbatch"], f["version"], f["on_alias"],
                                  get(f"forward/{k}/inp") if f["inp"] else None,
                                  {name: tensors[f"forward/{k}/batch/{name}"] if name in HOST_FIELDS else  # stays
                                   get(f"forward/{k}/batch/{name}") for name in f["batch"]},
                                  {name: tensors[f"forward/{k}/rng/{name}"] for name in f["rng"]})
                    for k, f in enumerate(meta["forwards"])]

        def waiting(kind: str) -> dict:
            return {tuple(key): get(f"{kind}/{'.'.join(map(str, key))}") for key in meta[kind]}

        return InFlight(meta["calls"], meta["base_versions"], stores, forwards, waiting("local_outputs"),
                        waiting("local_grads"), waiting("prereceived"),
                        [get(f"grads/{g}") for g in range(meta["grads"])])
