"""Starting torch.distributed and choosing the device, the only place that knows about CUDA.

Also where the host waits for the device: ``counting_synchronisations`` lists every such wait in
a block of code (CUDA's own sync debug mode on a GPU, every host read of a tensor's value on the
CPU), and ``count_synchronisations`` counts them over N calls of a step.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import warnings
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megapipe.errors import ConfigError
from megapipe.parallel.host_memory import keep_freed_host_memory

logger = logging.getLogger("megapipe")

def default_timeout() -> datetime.timedelta:
    """How long a collective or a peer's message may take: ``MEGAPIPE_TIMEOUT`` seconds (300 unless set), read
    at each call, so that a process forked from one that imported megapipe earlier sees its own environment."""
    return datetime.timedelta(seconds=int(os.environ.get("MEGAPIPE_TIMEOUT", "300")))


DEVICE_VARIABLE = "MEGAPIPE_DEVICE"


def default_device() -> torch.device:
    """The device this process computes on: ``MEGAPIPE_DEVICE`` (``cpu`` or ``cuda``) when set, else
    the local accelerator when there is one, else the CPU.

    Each process of a node takes the GPU numbered by its ``LOCAL_RANK``; a rank beyond the visible
    GPUs is refused, since two ranks on one GPU make NCCL fail or hang. ``MEGAPIPE_DEVICE=cpu``
    keeps a run (and the test suite) on the CPU and gloo on a machine that has GPUs.
    """
    requested = os.environ.get(DEVICE_VARIABLE, "").strip().lower()
    if requested not in ("", "cpu", "cuda"):
        raise ConfigError(f"{DEVICE_VARIABLE}={requested} is not a device megapipe runs on; set it to cpu or "
                          "cuda, or unset it to use a GPU when there is one.")
    if requested == "cpu" or (not requested and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{DEVICE_VARIABLE}=cuda, but torch sees no CUDA device here (torch.cuda.is_available() "
                          "is False); unset it to train on the CPU, or install a CUDA build of torch.")
    local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"LOCAL_RANK {local_rank} has no GPU of its own: this node shows {count} CUDA device(s); "
                          f"start at most {count} processes per node (torchrun --nproc-per-node {count}) or make "
                          "more GPUs visible (CUDA_VISIBLE_DEVICES).")
    return torch.device("cuda", local_rank)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def job_store(timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> dist.TCPStore:
    """A connection of its own to the job's key-value store (the TCP store at MASTER_ADDR:MASTER_PORT that
    torchrun's rendezvous serves): it answers while every communicator is stuck, and no other thread's
    blocking wait holds it (``training/hang_watchdog.py``)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout)


def init_distributed(timeout: datetime.timedelta | None = None, device: torch.device | None = None) -> torch.device:
    """Join the process group described by torchrun's environment (or a world of one).

    Returns the device this process computes on. Every collective inherits ``timeout`` (by default
    ``default_timeout()``), so a peer that dies makes the others fail with an error instead of
    hanging. On a GPU the world's
    NCCL communicator is created at once for this process's device (``device_id``), and every
    later NCCL group is split from it instead of being created lazily at its first collective.
    Gloo's interface is chosen whatever the default backend: NCCL runs have gloo side groups too
    (lagged agreements, asynchronous saves). On the CPU the C library's heap is asked to keep freed
    memory for the next pass (``host_memory.py``).
    """
    device, timeout = device or default_device(), timeout or default_timeout()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cpu":  # passes reuse freed memory instead of faulting it back in (``host_memory.py``)
        keep_freed_host_memory()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python script.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        choose_gloo_interface()
        # torch._dynamo (which the fused optimizers import) keeps references to the default group
        # when it is first imported after the group exists, so the group, and its threads, would
        # outlive ``close_distributed`` into the interpreter's teardown (``teardown.py``)
        import torch._dynamo  # noqa: F401
        eager = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(default_backend(device), timeout=timeout, **eager)
        if device.type == "cuda" and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" and dist.get_rank() == 0:
            logger.warning(SINGLE_CONNECTION_WARNING)
    return device


# Megatron-LM asks for one hardware queue per GPU so that a tensor-parallel collective issued
# before a matmul also runs before it. megapipe sends pipeline messages on communicators (and
# streams) of their own, which wait for a peer on another stage; through a single queue a
# collective issued later on the tensor group would wait behind such a receive, and ranks that
# issue them in different orders would wait for each other forever.
SINGLE_CONNECTION_WARNING = (
    "CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream of this GPU on one hardware queue, so a tensor-parallel "
    "collective can wait behind a pipeline receive that waits for it in turn; unset it for megapipe, whose "
    "pipeline and tensor-parallel communicators must progress independently.")


def choose_gloo_interface() -> None:
    """Point gloo at the interface that reaches ``MASTER_ADDR`` when its own choice could not reach peers.

    Gloo listens on the address this host's name resolves to. Where that is a loopback address
    (Debian's 127.0.1.1, or every network namespace of one machine, which share a hostname) while
    the rendezvous host is elsewhere, peers on other hosts would be told to connect to loopback and
    the job would fail to start. Then the interface the kernel routes ``MASTER_ADDR`` through is
    the one to use (``GLOO_SOCKET_IFNAME``, which a user's setting overrides).
    """
    import socket

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if "GLOO_SOCKET_IFNAME" in os.environ or _is_loopback(master):
        return
    try:
        if not _is_loopback(socket.gethostbyname(socket.gethostname())):
            return
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, 9))  # no packet is sent: this only asks the kernel for the route
            local = probe.getsockname()[0]
    except OSError:
        return  # let init_process_group report the unreachable address
    interface = _interface_with_address(local)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def _is_loopback(address: str) -> bool:
    import ipaddress
    import socket

    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def _interface_with_address(address: str) -> str | None:
    """The name of the interface holding IPv4 ``address`` (SIOCGIFADDR on each interface)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rng_state(device: torch.device) -> torch.Tensor:
    """The default generator state of ``device``."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int, device: torch.device) -> None:
    """Seed the generator that dropout on ``device`` draws from."""
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def device_name(device: torch.device) -> str:
    """The device's model as CUDA reports it ("NVIDIA H100 80GB HBM3"), or its type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``; a no-op on the CPU, where every op has finished on return."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start counting ``peak_memory_gib`` afresh (on an accelerator; the host's peak cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release_cached_memory(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the device, for the next program's peak."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated on the accelerator, resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # Linux reports KiB


class DeviceClock:
    """Marks in the device's own order of work, read later as seconds on the host clock.

    On an accelerator a host timestamp only says when work was queued, so a mark is a device
    event and ``seconds`` converts it (elapsed time from a base event recorded together with a
    host timestamp). On the CPU work finishes before the call returns and a mark is the host
    clock itself. Either way the times of all ranks share ``time.time()``'s origin, so recorded
    timelines merge and the bubble means the same on both devices.
    """

    def __init__(self, device: torch.device):
        import time

        self.device, self._time = device, time.time
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record()
        self._base_seconds = self._time()

    def mark(self):
        if self.device.type != "cuda":
            return self._time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, marks: list) -> list[float]:
        """Host-clock seconds of ``marks`` (waits for the device to reach them)."""
        if self.device.type != "cuda":
            return list(marks)
        if marks:
            marks[-1].synchronize()
        return [self._base_seconds + self._base.elapsed_time(event) / 1000 for event in marks]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``: through pinned memory and without blocking the host
    when ``device`` is an accelerator, so the copy overlaps the work already queued."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


# The Tensor methods that read a value to the host: each waits for the device on an accelerator.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def counting_synchronisations(device: torch.device) -> Iterator[list[str]]:
    """Within the block, every point where the host waits for ``device``, as a list of
    ``"what at file:line"`` (complete when the block ends).

    On CUDA: what ``torch.cuda.set_sync_debug_mode("warn")`` reports as warnings (a device-to-host
    copy, a stream or device synchronisation, an op whose output size depends on the data); the
    block's other warnings are shown as usual when it ends. Elsewhere
    (the CPU, where nothing waits): every read of a tensor's value on the host (``HOST_READS``,
    patched on ``torch.Tensor`` for the block), each of which waits on an accelerator. A read of a
    host tensor counts there too; host memory read through ``Tensor.numpy()`` does not (a device
    tensor refuses it), nor does a copy to the host (``.cpu()``) or an op whose output size depends
    on the data, which the CUDA count covers.
    """
    found: list[str] = []
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        for w in caught:
            if CUDA_SYNC_WARNING in str(w.message):
                found.append(f"{CUDA_SYNC_WARNING} at {w.filename}:{w.lineno}")
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        return
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            found.append(f"Tensor.{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield found
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def count_synchronisations(step: Callable[[], object], iterations: int, device: torch.device) -> int:
    """How often the host waits for ``device`` in ``iterations`` calls of ``step`` (see
    ``counting_synchronisations``). Warm ``step`` up first: lazy state made at a first call may
    read the device once. ``Trainer.count_synchronisations`` runs training iterations this way."""
    with counting_synchronisations(device) as found:
        for _ in range(iterations):
            step()
    return len(found)
