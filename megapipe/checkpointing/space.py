"""Disk space of a save: what a checkpoint needs, what was free, and the sentence when it ran out.

A save that fills its disk fails deep inside ``torch.save`` (``enforce fail at
inline_container.cc``), which names neither the disk nor the cause; ``Room`` measures before the
save what the checkpoint needs and what is free, so that a failed save can say both.
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from dataclasses import dataclass

import torch.distributed as dist

from megapipe.checkpointing.shards import Shard

MIB = 2 ** 20


@dataclass(frozen=True)
class Room:
    """Bytes the checkpoint's tensors take (every piece once, over all ranks) and bytes free on its disk."""

    needed: int
    free: int

    @staticmethod
    def measure(shards: dict[str, Shard], directory: str) -> "Room":
        """Collective over all ranks: each tensor counts once, at its whole size, whichever ranks hold pieces."""
        sizes = {key: math.prod(s.global_shape) * s.local.element_size() for key, s in shards.items()}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sizes)
        needed = sum({key: size for ranks_sizes in gathered for key, size in ranks_sizes.items()}.values())
        return Room(needed, shutil.disk_usage(directory).free)

    def ran_out(self, error: BaseException, staging: str) -> bool:
        """Whether ``error`` of a save into ``staging`` came from a full disk: an ENOSPC, or less room left
        than the rest of the checkpoint needs."""
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        try:
            left = shutil.disk_usage(staging).free
        except OSError:
            return False
        return left < self.needed - _bytes_in(staging)

    def sentence(self, iteration: int, staging: str) -> str:
        return (f"saving the checkpoint of iteration {iteration} into {staging} ran out of disk space: it needs about "
                f"{self.needed / MIB:.1f} MiB and {self.free / MIB:.1f} MiB were free when the save began; free space "
                "on that disk or point --save at a larger one.")


def _bytes_in(directory: str) -> int:
    try:
        return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.is_file())
    except OSError:
        return 0
