"""One model chunk's gradients and weights across data-parallel replicas: their one owner of communication.

``GradSync`` owns the chunk's contiguous main-gradient buffer, its buckets, and every
data-parallel collective on the chunk's gradients and weights; no other module calls one.

* Gradients: each parameter's ``main_grad`` is a view into one flat buffer, filled by a
  post-accumulate-grad hook (or, for a stashed weight version, by ``accumulate``); with
  ``fuse_products`` (gradient-accumulation fusion, ``tensor_parallel/grad_accumulation.py``) the
  linears' backward adds its weight-gradient products into it directly, and the same hook, which
  autograd runs once per backward after a weight's last use, counts such a gradient ready. A bucket is
  averaged over the data-parallel group (all-reduce, or reduce-scatter into this rank's shard
  when the optimizer is sharded). Under context parallelism that group is the d x c ranks of a
  (tensor, pipeline) position: each context rank's backward gives its tokens' share of the gradient
  (the loss is scaled by c, Megatron's rule), so the average over d x c is the whole gradient, and
  shards are cut over d x c. "Data-parallel" below means those ranks. With ``overlap_grad_reduce`` a bucket starts from the hook
  of its last gradient during the final backward before a step (``begin_backward(final=True)``),
  so reductions run while backward goes on; ``finish`` waits only for what is in flight.
* Experts (``expert_parallel`` parameters under expert parallelism) sit in buckets of their own,
  whose collectives run over the expert-data-parallel group: the ranks holding the same experts.
  They are still divided by the whole data-parallel size, since every replica's tokens reached
  them through the token exchange (Megatron-core's rule).
* Late parameters: the tied word embedding (first and last stage) and sequence-parallel
  parameters are first summed over the embedding / tensor group, then reduced in a bucket of
  their own at ``finish``; the sums are linear, so their order with the average is free.
* Weights (sharded levels): parameters become views of one flat weight buffer laid out like
  the gradients, each bucket padded to a multiple of d so that every rank owns an equal slice
  of every bucket. The optimizer steps this rank's slices (``pieces``); ``publish_weights``
  all-gathers them back, or, with ``overlap_param_gather``, starts that and the chunk's next
  forward waits (``wait_for_weights``). At ``optim_grads_params`` the weights are released after each
  pass and gathered again before the next (``gather_weights``), or a layer at a time around it
  (``unit_weights.py``): each bucket has a weight buffer of its own.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megapipe.parallel.collectives import all_gather_into, all_reduce, all_reduce_coalesced, reduce_scatter_into
from megapipe.config.sharding import ShardingLevel
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.grad_accumulation import SUMMED_BY_AUTOGRAD, TARGET, MainGradTarget
from megapipe.tensor_parallel.utils import is_expert_parallel
from megapipe.parallel import progress

DEFAULT_BUCKET_SIZE = 40_000_000  # elements per data-parallel reduction, Megatron's --ddp-bucket-size


def bucket_boundaries(sizes: list[int], bucket_size: int) -> list[tuple[int, int]]:
    """Split consecutive tensors of ``sizes`` elements into ``[start, end)`` element ranges.

    A bucket closes after the tensor that brings it to ``bucket_size`` elements or more, so no
    tensor straddles two buckets and every bucket but the last holds at least ``bucket_size``.
    """
    bounds, start, end = [], 0, 0
    for size in sizes:
        end += size
        if end - start >= bucket_size:
            bounds.append((start, end))
            start = end
    if end > start or not bounds:
        bounds.append((start, end))
    return bounds


def is_tied_embedding_copy(param: torch.Tensor) -> bool:
    """The first stage's word embedding (``tied_embedding``) or the last stage's copy (``shared_embedding``)."""
    return getattr(param, "tied_embedding", False) or getattr(param, "shared_embedding", False)


@dataclass
class Bucket:
    """Parameters whose gradients are reduced by one collective; ``[start, end)`` in the buffer, padded."""

    index: int
    start: int
    end: int
    params: list[torch.nn.Parameter]
    offsets: list[int]  # each parameter's first element in the buffer
    late: bool  # reduced at finish, after the embedding / sequence-parallel sums
    experts: bool = False  # reduced over the expert-data-parallel group

    def shard(self, rank: int, size: int) -> tuple[int, int]:
        """The buffer range of ``rank``'s equal slice of this bucket."""
        length = (self.end - self.start) // size
        return self.start + rank * length, self.start + (rank + 1) * length


@dataclass
class ParamPiece:
    """The part of a parameter inside this rank's shard: what a sharded optimizer steps."""

    param: torch.nn.Parameter
    offset: int  # first element of the piece in the flattened parameter
    weight: torch.Tensor  # its block of this rank's weight shard (model dtype)
    grad: torch.Tensor  # its block of this rank's reduced gradient shard
    bucket: int
    shard_offset: int  # first element of the piece in the bucket's shard


def piece_of(piece: ParamPiece, whole: torch.Tensor) -> torch.Tensor:
    """``piece``'s block of a whole tensor shaped like its parameter (a weight, a moment)."""
    return whole.reshape(-1)[piece.offset:piece.offset + piece.weight.numel()]


def plan_buckets(params: list[torch.nn.Parameter], bucket_size: int, pad_to, late,
                 experts=lambda param: False, unit=None) -> list[Bucket]:
    """Buckets in reverse registration order (roughly the order backward finishes gradients), the experts'
    after the others', late ones last; ``pad_to`` is an int, or a function of whether a bucket holds experts;
    ``unit`` (a function of a parameter), where given, closes a bucket wherever it changes, so that no bucket
    holds two units' parameters (``optim_grads_params`` gathers and frees a layer's buckets alone)."""
    buckets, offset = [], 0
    for is_late, of_experts in ((False, False), (False, True), (True, False), (True, True)):
        group = [p for p in reversed(params) if bool(late(p)) == is_late and bool(experts(p)) == of_experts]
        runs = [list(run) for _, run in itertools.groupby(group, key=unit)] if unit is not None else [group]
        for run in (run for run in runs if run):
            bounds = bucket_boundaries([p.numel() for p in run], bucket_size)
            members: list[list] = [[] for _ in bounds]
            index = 0
            for param, end in zip(run, itertools.accumulate(p.numel() for p in run)):
                while bounds[index][1] < end:
                    index += 1
                members[index].append(param)
            for (start, end), bucket_params in zip(bounds, members):
                offsets = [offset + before for before in itertools.accumulate(
                    [p.numel() for p in bucket_params[:-1]], initial=0)]
                multiple = pad_to(of_experts) if callable(pad_to) else pad_to
                padded = -(-(end - start) // multiple) * multiple
                buckets.append(Bucket(len(buckets), offset, offset + padded, bucket_params, offsets, is_late,
                                      of_experts))
                offset += padded
    return buckets


def _common(values: set, what: str):
    if len(values) > 1:
        raise ValueError(f"one model chunk holds parameters with several {what} {sorted(map(str, values))}; "
                         f"move them to one before building its gradient sync.")
    return values.pop() if values else None


@dataclass
class ReductionRecord:
    """When a bucket's data-parallel reduction was issued and when its wait returned (host clock)."""

    bucket: int
    started: float
    finished: Optional[float] = None


def _weak_hook(sync: "GradSync"):
    """``sync._hook`` without a strong reference to ``sync``: a parameter's hooks live on its C++ side,
    where Python's garbage collector cannot see the cycle parameter -> hook -> GradSync -> parameter,
    so a strong one would keep every model whose gradients were ever synced alive (and on a GPU, its
    weights, gradients and optimizer state) after its last user let it go."""
    ref = weakref.ref(sync)

    def hook(param: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive._hook(param)

    return hook


class GradSync:
    """Gradients and weights of one model chunk over the data-parallel group (see the module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], ps: ParallelState, level: ShardingLevel = ShardingLevel(),
                 bucket_size: int = DEFAULT_BUCKET_SIZE, grad_dtype: torch.dtype = torch.float32,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False, fuse_products: bool = True,
                 unit=None):
        self.params, self.ps, self.level = params, ps, level
        self.overlap_grad_reduce, self.overlap_param_gather = overlap_grad_reduce, overlap_param_gather
        self.dp = ps.dp_cp_size  # the gradients are averaged over every data-parallel replica and context rank
        device = _common({p.device for p in params}, "devices")
        self.param_dtype = _common({p.dtype for p in params}, "dtypes")
        self.buckets = plan_buckets(params, bucket_size,
                                    lambda experts: self._size(experts) if level.shards_optimizer else 1,
                                    self._is_late, self._is_expert, unit if level.shards_params else None)
        total = self.buckets[-1].end if self.buckets else 0
        self.buffer = torch.zeros(total, dtype=grad_dtype, device=device)
        self._bucket_of: dict[int, Bucket] = {}
        for bucket in self.buckets:
            for param, offset in zip(bucket.params, bucket.offsets):
                param.main_grad = self.buffer[offset:offset + param.numel()].view_as(param)
                param.grad_sync = self
                fused = fuse_products and not getattr(param, SUMMED_BY_AUTOGRAD, False)
                setattr(param, TARGET, MainGradTarget(functools.partial(self._open, param),
                                                      functools.partial(self.accumulate, param, None))
                        if fused else None)
                self._bucket_of[id(param)] = bucket
        self._written: set[int] = set()  # parameters a backward added products into since their last hook
        self._grad_released = False
        self._released: set[int] = set()  # buckets whose full weights are freed (optim_grads_params)
        self._final_backward = False
        self._ready: dict[int, set] = {}
        self._works: dict[int, Optional[dist.Work]] = {}
        self._weight_works: dict[int, tuple] = {}  # bucket index -> (its gather's work, group), in flight
        self._weight_lock = threading.Lock()
        self._all_started = False
        self.reductions: Optional[list[ReductionRecord]] = None  # set to [] to record reduction times
        self.pieces: list[ParamPiece] = []
        if level.shards_optimizer:
            self._shard_weights(total, device)
        hook = _weak_hook(self)
        for param in params:
            param.register_post_accumulate_grad_hook(hook)

    def _is_late(self, param: torch.Tensor) -> bool:
        return ((self.ps.pp_size > 1 and is_tied_embedding_copy(param))
                or (self.ps.tp_size > 1 and getattr(param, "sequence_parallel", False)))

    def _is_expert(self, param: torch.Tensor) -> bool:
        """Experts sit apart when their copies differ from the dense layers': split over expert ranks, or
        below t, where every share of the tensor group holds (and gives gradients to) the same experts."""
        return is_expert_parallel(param) and (self.ps.ep_size > 1 or self.ps.etp_size < self.ps.tp_size)

    def _size(self, experts: bool) -> int:
        """Ranks a bucket's collectives run over: the expert-data-parallel group for experts, else the data one."""
        return self.ps.expert_dp_size if experts else self.dp

    def _over(self, bucket: Bucket) -> tuple:
        """(group, size, this rank's index) of ``bucket``'s collectives."""
        if bucket.experts:
            return self.ps.expert_dp_group, self.ps.expert_dp_size, self.ps.expert_dp_rank
        return self.ps.dp_cp_group, self.dp, self.ps.dp_cp_rank

    def _shard_weights(self, total: int, device) -> None:
        """Make the parameters views of their bucket's weight buffer (one storage per bucket, so that
        ``optim_grads_params`` can free and gather one layer's alone) and cut this rank's shards of weights
        and gradients."""
        self.bucket_weights = [torch.zeros(b.end - b.start, dtype=self.param_dtype, device=device)
                               for b in self.buckets]
        with torch.no_grad():
            for bucket in self.buckets:
                for param, offset in zip(bucket.params, bucket.offsets):
                    view = self._weight_view(bucket, offset, param.numel())
                    view.copy_(param.detach().reshape(-1))
                    param.data = view.view_as(param)
        sizes = [(b.end - b.start) // self._over(b)[1] for b in self.buckets]
        self.grad_shard = torch.zeros(sum(sizes), dtype=self.buffer.dtype, device=device)
        grad_shards = self.grad_shard.split(sizes)
        ranges = [b.shard(self._over(b)[2], self._over(b)[1]) for b in self.buckets]
        # the shard the optimizer writes lives apart from the weight buffer, which a weight version
        # store may hand to a stashed version (``renew_weights``) and optim_grads_params releases
        self.weight_shard = torch.cat([self._weight_view(b, s, e - s) for b, (s, e) in zip(self.buckets, ranges)]) \
            if ranges else torch.zeros(0, dtype=self.param_dtype, device=device)
        weight_shards = list(self.weight_shard.split(sizes))
        self._grad_shards, self._weight_shards = list(grad_shards), weight_shards
        for bucket, (start, end) in zip(self.buckets, ranges):
            for param, offset in zip(bucket.params, bucket.offsets):
                low, high = max(start, offset), min(end, offset + param.numel())
                if low < high:
                    self.pieces.append(ParamPiece(param, low - offset, weight_shards[bucket.index][low - start:high - start],
                                                  grad_shards[bucket.index][low - start:high - start],
                                                  bucket.index, low - start))
        if self.level.shards_params:
            self.release_weights()

    def _weight_view(self, bucket: Bucket, offset: int, numel: int) -> torch.Tensor:
        """``numel`` weights from ``offset`` (of the whole chunk's layout) in ``bucket``'s buffer."""
        start = offset - bucket.start
        return self.bucket_weights[bucket.index][start:start + numel]

    # ---- gradients ------------------------------------------------------------------------------
    def _hook(self, param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        self.accumulate(param, grad)

    def _open(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s main gradient, which a backward is about to add a product into (``MainGradTarget``)."""
        self._ensure_grad_buffer()
        self._written.add(id(param))
        return param.main_grad

    def accumulate(self, param: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        """Add one backward's gradient of ``param`` into its main gradient; start its bucket once complete.
        ``grad`` None: autograd brought none, because the backward added its products into the main gradient
        itself (counted now) or a split backward's BI left them to its BW (nothing to count yet)."""
        written = id(param) in self._written
        self._written.discard(id(param))
        if grad is not None:
            self._ensure_grad_buffer()
            param.main_grad.add_(grad)
        elif not written:
            return
        if not (self._final_backward and self.overlap_grad_reduce):
            return
        bucket = self._bucket_of[id(param)]
        if bucket.late:
            return
        if bucket.index in self._works:
            raise RuntimeError(f"a gradient of a {tuple(param.shape)} parameter arrived after its bucket's "
                               "data-parallel reduction started; more backwards ran before the step than the "
                               "schedule announced")
        ready = self._ready.setdefault(bucket.index, set())
        ready.add(id(param))
        if len(ready) == len(bucket.params):
            self._start(bucket)

    def begin_backward(self, final: bool) -> None:
        """Announce the next backward of this chunk; ``final``: the last one before the step."""
        self._final_backward = final

    def _ensure_grad_buffer(self) -> None:
        if self._grad_released:
            self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
            self.buffer.zero_()
            self._grad_released = False

    def _start(self, bucket: Bucket) -> None:
        grads = self.buffer[bucket.start:bucket.end]
        if self.reductions is not None:
            self.reductions.append(ReductionRecord(bucket.index, time.time()))
        group, size, _ = self._over(bucket)
        if self.dp > 1:
            grads.mul_(1.0 / self.dp)  # divide before the sum, as Megatron does: keeps fp32 sums in range
        if not self.level.shards_optimizer:
            work = all_reduce(grads, group, size, async_op=True)
        elif size == 1:
            self._grad_shards[bucket.index].copy_(grads)
            work = None
        else:
            work = reduce_scatter_into(self._grad_shards[bucket.index], grads, group, async_op=True)
        self._works[bucket.index] = work

    def start_grad_sync(self) -> None:
        """Sum the late parameters over their groups and start every bucket not yet started (once per step)."""
        if self._all_started:
            return
        self._all_started = True
        self._ensure_grad_buffer()
        late = [p for bucket in self.buckets if bucket.late for p in bucket.params]
        tied = [p.main_grad for p in late if is_tied_embedding_copy(p)]
        if tied:
            all_reduce_coalesced(tied, self.ps.embedding_group, len(self.ps.members["embedding"]))
        sliced = [p.main_grad for p in late if getattr(p, "sequence_parallel", False)]
        all_reduce_coalesced(sliced, self.ps.tp_group, self.ps.tp_size)
        for bucket in self.buckets:
            if bucket.index not in self._works:
                self._start(bucket)

    def finish_grad_sync(self) -> None:
        """Wait for this step's reductions (starting what is not yet started); at ``optim_grads`` and
        above the full buffer is then released: only this rank's reduced shard is kept."""
        self.start_grad_sync()
        for index, work in self._works.items():
            if work is not None:
                with progress.collective(f"the wait for gradient bucket {index}'s reduction", self._over(
                        self.buckets[index])[0], counted=False):
                    work.wait()
            if self.reductions is not None:
                record = next(r for r in reversed(self.reductions) if r.bucket == index)
                record.finished = record.finished or time.time()
        self._works = {index: None for index in self._works}
        if self.level.shards_grads and not self._grad_released:
            self.buffer.untyped_storage().resize_(0)
            self._grad_released = True

    def reduce_across_replicas(self, group, replicas: int):
        """Start the average, over ``replicas`` fault-tolerant replicas, of the reduced gradients this rank
        steps (its shard under a sharded optimizer, else the whole buffer), on ``group``: a process group of
        this rank's counterparts in the other replicas (``replicas/group.py``). Divided before the sum as
        in ``_start``, so that one rank per replica reduces exactly as the data-parallel group of a run
        without replicas; the work to wait for."""
        grads = self.grad_shard if self.level.shards_optimizer else self.buffer
        grads.mul_(1.0 / replicas)
        return group.allreduce([grads])

    def zero(self) -> None:
        """Clear the gradients before the next step's first microbatch."""
        if any(work is not None for work in self._works.values()):
            raise RuntimeError("zero() called while a data-parallel gradient reduction is in flight; "
                               "call finish_grad_sync() first.")
        if not self._grad_released:
            self.buffer.zero_()  # a released buffer comes back zeroed at the next gradient
        self._works, self._ready, self._all_started, self._final_backward = {}, {}, False, False
        self._written.clear()

    def grad_state(self) -> torch.Tensor:
        """A copy of the unreduced gradients accumulated so far (an asynchronous pipeline's checkpoint)."""
        self._ensure_grad_buffer()
        return self.buffer.detach().clone()

    def load_grad_state(self, saved: torch.Tensor) -> None:
        self._ensure_grad_buffer()
        with torch.no_grad():
            self.buffer.copy_(saved)

    # ---- weights (sharded levels) ---------------------------------------------------------------
    def publish_weights(self) -> None:
        """After the optimizer wrote this rank's shard: all-gather the updated weights into the model
        (started now and awaited by the next forward with ``overlap_param_gather``)."""
        if not self.level.shards_optimizer:
            return
        if self.level.shards_params and not self.overlap_param_gather:
            return  # gathered before the next pass
        self._start_weight_gather()
        if not self.overlap_param_gather:
            self.wait_for_weights()

    def _start_weight_gather(self) -> None:
        """Start every bucket's all-gather, in the order the forward first uses the buckets (the buckets are
        laid out in backward order): the first bucket a forward waits for is the first to arrive."""
        for bucket in self._forward_order:
            self._gather(bucket)

    def gather_buckets(self, indices) -> None:
        """Start the all-gathers of the listed buckets that are released and not already on their way
        (``optim_grads_params``: a layer's weights before it runs, ``unit_weights.py``)."""
        with self._weight_lock:
            for bucket in self._forward_order:
                if bucket.index in indices and bucket.index in self._released:
                    self._gather(bucket)

    def _gather(self, bucket: Bucket) -> None:
        full, shard = self.bucket_weights[bucket.index], self._weight_shards[bucket.index]
        if bucket.index in self._released:
            full.untyped_storage().resize_(full.numel() * full.element_size())
            self._released.discard(bucket.index)
        group, size, _ = self._over(bucket)
        if size == 1:
            full.copy_(shard)
        else:
            self._weight_works[bucket.index] = (all_gather_into(full, shard, group, async_op=True), group)

    @functools.cached_property
    def _forward_order(self) -> list[Bucket]:
        registered = {id(param): i for i, param in enumerate(self.params)}
        return sorted(self.buckets, key=lambda bucket: min(registered[id(param)] for param in bucket.params))

    @functools.cached_property
    def _forward_position(self) -> dict[int, int]:
        return {bucket.index: position for position, bucket in enumerate(self._forward_order)}

    @property
    def weights_per_unit(self) -> bool:
        """Whether a pass handles the weights a layer at a time (``unit_weights.py``): ZeRO-1/2 with
        ``overlap_param_gather`` (the gathers started after the step are still in flight when the forward
        begins), and ZeRO-3 (gathered and freed around each layer)."""
        return self.level.shards_params or (self.overlap_param_gather and self.level.shards_optimizer)

    def bucket_indices(self, params) -> set[int]:
        """The buckets ``params`` (some of this chunk's) sit in."""
        return {self._bucket_of[id(param)].index for param in params if id(param) in self._bucket_of}

    def wait_for_buckets(self, indices) -> None:
        """Block until the listed buckets' weights are whole (per layer, ``unit_weights.py``)."""
        with self._weight_lock:  # a pass on another thread waiting for the same bucket waits for its end too
            for index in sorted(indices, key=self._forward_position.__getitem__):
                pending = self._weight_works.pop(index, None)
                if pending is not None:
                    work, group = pending
                    with progress.collective(f"the wait for weight bucket {index}'s gather", group, counted=False):
                        work.wait()

    def renew_weights(self) -> None:
        """Move the parameters to a fresh copy of the weight buffer, leaving the old storage to a
        stashed weight version (copy-on-write before an update of an asynchronous schedule)."""
        self.wait_for_weights()
        self.bucket_weights = [weights.clone() for weights in self.bucket_weights]
        with torch.no_grad():
            for bucket in self.buckets:
                for param, offset in zip(bucket.params, bucket.offsets):
                    param.data = self._weight_view(bucket, offset, param.numel()).view_as(param)

    def wait_for_weights(self) -> None:
        """Block until the weights of this chunk are whole (a no-op when they already are)."""
        self.wait_for_buckets(list(self._weight_works))

    def gather_weights(self) -> None:
        """Make the chunk's weights whole before a pass (``optim_grads_params``; otherwise only waits)."""
        self.gather_buckets({bucket.index for bucket in self.buckets})
        self.wait_for_weights()

    def release_weights(self) -> None:
        """Free the full weights after a pass (``optim_grads_params``), keeping this rank's shard."""
        self.release_buckets([bucket.index for bucket in self.buckets])

    def release_buckets(self, indices) -> None:
        """Free the listed buckets' full weights (``optim_grads_params``), keeping this rank's shard of them."""
        if not self.level.shards_params:
            return
        self.wait_for_buckets(indices)
        for index in indices:
            if index not in self._released:
                self.bucket_weights[index].untyped_storage().resize_(0)
                self._released.add(index)

    # ---- whole tensors from shards (checkpoints) ------------------------------------------------
    def gather_full(self, values: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each parameter's whole tensor assembled from every rank's ``values`` (one per piece, in
        ``pieces`` order); collective over the data-parallel group. Keyed by ``id(param)``."""
        dtype = values[0].dtype if values else torch.float32
        shards = [torch.zeros((b.end - b.start) // self._over(b)[1], dtype=dtype, device=self.buffer.device)
                  for b in self.buckets]
        for piece, value in zip(self.pieces, values):
            shards[piece.bucket][piece.shard_offset:piece.shard_offset + value.numel()].copy_(value.reshape(-1))
        full = torch.empty(self.buffer.numel(), dtype=dtype, device=self.buffer.device)
        for bucket, shard in zip(self.buckets, shards):
            group, size, _ = self._over(bucket)
            if size == 1:
                full[bucket.start:bucket.end].copy_(shard)
            else:
                all_gather_into(full[bucket.start:bucket.end], shard, group)
        return {id(param): full[offset:offset + param.numel()].view_as(param).clone()
                for bucket in self.buckets for param, offset in zip(bucket.params, bucket.offsets)}

    def held_bytes(self) -> dict[str, int]:
        """Bytes this chunk holds now in gradients and weights, counted from the tensors themselves."""
        def size(t: Optional[torch.Tensor]) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()
        if not self.level.shards_optimizer:
            return {"grads": size(self.buffer), "weights": sum(p.numel() * p.element_size() for p in self.params)}
        return {"grads": size(self.buffer) + size(self.grad_shard),
                "weights": sum(map(size, self.bucket_weights)) + size(self.weight_shard)}
