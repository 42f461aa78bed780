"""Runs one pipeline rank's actions for real: forward, backward, messages, step, update.

The executor knows nothing about which schedule it runs; the list says everything (see
``actions.py`` for each kind's meaning and the posting contract). It runs a *program*
(``program.py``): a flush schedule's whole list every call, or one segment of an
asynchronous schedule per call, with what is in flight (activations, posted sends, weight
versions) carried over to the next call until ``drain``; ``in_flight`` records that state for a
checkpoint and ``restore_in_flight`` rebuilds it (``in_flight.py``). Activations are released
as soon as the schedule allows: a sent output's data once its send is posted (its autograd graph
stays for the backward; the send holds the storage until it completes), a stage's saved input
and graph after its backward, and everything of a forward at once when the list has no
backward (evaluation).

Overlapped pairs: with ``overlap_pairs`` (``--overlap-moe-expert-parallel-comm``) an overlapped
backward (``&B``) runs together with the forward before it (``pairs.py``), each pass's expert
all-to-all beside the other's compute; without it the pair runs one pass after the other.

Weight versions: with weight stores (``weights.py``, one per chunk) every forward runs against
the version its action names, and its backward, through the saved autograd graph, against the
same one; STEP and UPDATE go through the stores so a version still needed survives the
in-place optimizer update.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch
from torch.autograd.variable import Variable
from torch.func import functional_call

from megapipe.parallel.launch import DeviceClock
from megapipe.models.loss_parts import parts_of
from megapipe.parallel.state import ParallelState
from megapipe.tensor_parallel.split_backward import apply_weight_gradients, deferring_weight_gradients
from megapipe.schedules.actions import Action, ActionKind, Schedule
from megapipe.pipeline.in_flight import ForwardRecord, InFlight
from megapipe.pipeline.lookahead import Lookahead
from megapipe.pipeline.p2p import StageP2P, Transfer
from megapipe.pipeline.pairs import run_pair
from megapipe.pipeline.streams import PassStreams
from megapipe.schedules.replay import overlap_partners
from megapipe.schedules.program import FlushProgram
from megapipe.schedules.analysis.timeline import Timeline
from megapipe.pipeline.weights import VersionUse, WeightVersionStore
from megapipe.parallel.random import capture_rng, restore_rng
from megapipe.config.schema import COLLECTIVE_TIMEOUT
from megapipe.parallel import progress


@dataclass
class BatchResult:
    """What one call produced on this rank: losses of the microbatches its last stage forwarded.

    The losses stay on the device (0-dim tensors, detached) so a call makes no host
    synchronisation; ``losses`` and ``parts`` read them as numbers for code that wants them now.
    """

    loss_tensors: list[torch.Tensor]
    peak_in_flight: int  # most microbatch activations held at once, summed over this rank's chunks
    part_tensors: list[dict[str, torch.Tensor]] = field(default_factory=list)  # named components of each loss

    @property
    def losses(self) -> list[float]:
        return _numbers(self.loss_tensors)

    @property
    def parts(self) -> list[dict[str, float]]:
        return [dict(zip(named, _numbers(list(named.values())))) for named in self.part_tensors]


def _numbers(tensors: list[torch.Tensor]) -> list[float]:
    """Tensors as floats, read from the device at once (one synchronisation)."""
    return torch.stack(tensors).double().tolist() if tensors else []


class PipelineExecutor:
    """Executes rank ``ps.pp_rank``'s part of ``program`` (or of a Schedule, run as a flush program).

    ``step`` is called for STEP (after the flush) and ``update(chunk)`` for UPDATE: they
    finalise gradients and update weights, returning the optimizer's result. ``scale_loss``
    turns a microbatch loss into the tensor to differentiate (for example times a loss
    scale); the executor itself divides by the number of microbatches one update applies, so
    each update applies the mean gradient. ``versions_used``, when given, records for every
    pass ``(kind, stage, microbatch) -> version`` as the weight store saw it.
    """

    def __init__(self, chunks: list[torch.nn.Module], ps: ParallelState, program: Union[Schedule, object],
                 boundary_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 step: Callable[[], object], scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                 scatter_gather: bool = True, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
                 timeline: Optional[Timeline] = None, stores: Optional[list[WeightVersionStore]] = None,
                 update: Optional[Callable[[int], object]] = None, versions_used: Optional[dict] = None,
                 deallocate_sent_outputs: bool = True, passes=None, overlap_pairs: bool = False):
        self.program = FlushProgram(program) if isinstance(program, Schedule) else program
        self.schedule = self.program.schedule
        if self.schedule.p != ps.pp_size or self.schedule.v != len(chunks):
            raise ValueError(f"schedule for p={self.schedule.p}, v={self.schedule.v} given to a rank with "
                             f"p={ps.pp_size} and {len(chunks)} model chunks")
        self.chunks, self.ps = chunks, ps
        self.step, self.update, self.scale_loss, self.timeline = step, update, scale_loss, timeline
        self.stores, self.versions_used = stores, versions_used
        self.passes = passes  # data-parallel hooks around each pass (``optim/passes.py``), or None
        self.deallocate_sent_outputs = deallocate_sent_outputs
        self.overlap_pairs = overlap_pairs
        # a list without backwards (evaluation) keeps nothing of a forward once its output is passed on
        self.keeps_graphs = self.program.asynchronous or any(a.kind.is_backward for actions in self.schedule.actions
                                                             for a in actions)
        self.p2p = StageP2P(ps, boundary_shape, dtype, device, scatter_gather, timeout)
        self.streams = PassStreams(device)  # on CUDA, an overlapped pair's passes on two streams
        self.clock = DeviceClock(device) if timeline is not None else None
        self.lookahead = Lookahead(self.program, ps.pp_rank)
        self.calls = 0  # calls run since the pipeline was last empty
        self.state = _State()
        self._base_versions = [0] * len(chunks)

    # ---- calls ----------------------------------------------------------------------------------
    def run(self, microbatches: list[dict]) -> BatchResult:
        """Run one batch of m microbatches (each a dict of tensors): one call of the program."""
        if len(microbatches) != self.schedule.m:
            raise ValueError(f"schedule expects {self.schedule.m} microbatches, got {len(microbatches)}")
        if self.calls == 0 and self.stores is not None:
            self._base_versions = [store.live_version for store in self.stores]
        first = self.program.first_microbatch(self.calls)
        result = self._execute(self.program.segment(self.ps.pp_rank, self.calls), self.calls,
                               lambda i: microbatches[i - first])
        self.calls += 1
        if not self.program.asynchronous:  # a flush leaves nothing in flight (forward-only lists leave no B)
            self._finish(check_empty=False)
        return result

    def losses_so_far(self) -> BatchResult:
        """The losses of the call under way (``run`` returns them at its end), for a step taken inside it."""
        state = self.state
        return BatchResult(state.losses, state.peak_in_flight, state.loss_parts if any(state.loss_parts) else [])

    def drain(self) -> BatchResult:
        """Run the backwards and updates still in flight; afterwards the pipeline is empty."""
        if self.calls == 0:
            return BatchResult([], 0)
        for store in self.stores or ():
            store.forget_future()
        result = self._execute(self.program.drain(self.ps.pp_rank, self.calls), None, None)
        self._finish(check_empty=True)
        return result

    # ---- checkpoints between calls --------------------------------------------------------------
    def in_flight(self) -> Optional[InFlight]:
        """What this rank holds between two calls, for a checkpoint; None when the pipeline is empty.

        Every message is sent and received within one call (``communication.lower_calls``), so
        between calls nothing is in transit: receives posted for a later call's compute are
        completed and kept, sends are completed. Training then goes on exactly as without the
        checkpoint.
        """
        if self.calls == 0:
            return None
        state = self.state
        for (kind, stage, microbatch), transfer in list(state.recvs.items()):  # received for a later call
            state.prereceived[(kind, stage, microbatch)] = self.p2p.received(transfer)
        state.recvs = {}
        for transfer in state.sends:
            self.p2p.wait(transfer)
        state.sends = []
        unsent = [name for name in ("outputs_to_send", "input_grads") if getattr(state, name)]
        if unsent:
            raise RuntimeError(f"rank {self.ps.rank}: {unsent} hold messages between two calls; the schedule's "
                               "segments should post every send in the call that computes it")
        forwards = [ForwardRecord(stage, microbatch, None if saved.use is None else saved.use.version,
                                  saved.use is not None and saved.use.weights is not None,
                                  None if saved.inp is None else saved.inp.detach(), saved.batch, saved.rng)
                    for (stage, microbatch), saved in state.saved.items()]
        return InFlight(self.calls, list(self._base_versions), [store.checkpoint_state() for store in self.stores],
                        forwards, dict(state.local_outputs), dict(state.local_grads),
                        {(kind.value, stage, mb): t for (kind, stage, mb), t in state.prereceived.items()})

    def restore_in_flight(self, snapshot: InFlight) -> None:
        """Rebuild what ``in_flight`` recorded (on an empty pipeline, with the live weights loaded):
        each in-flight forward runs again on its version, input, data and random states."""
        if self.calls:
            raise RuntimeError("restore_in_flight needs an empty pipeline; drain it first")
        state = _State()
        state.local_outputs, state.local_grads = dict(snapshot.local_outputs), dict(snapshot.local_grads)
        state.prereceived = {(ActionKind(kind), stage, mb): t for (kind, stage, mb), t in snapshot.prereceived.items()}
        for store, saved in zip(self.stores or (), snapshot.stores):
            store.start_replay(saved)
        for record in snapshot.forwards:
            use = None
            if self.stores is not None:
                use = self.stores[self.schedule.chunk_of_stage(record.stage)].forward(record.version, record.on_alias)
            inp = None if record.inp is None else record.inp.detach().clone().requires_grad_(True)
            restore_rng(record.rng, self.ps.rng_tracker, self.p2p.device)
            self._run_forward(record.stage, record.microbatch, inp, record.batch, use, record.rng, state)
        for store in self.stores or ():
            store.finish_replay()
        self.state, self.calls, self._base_versions = state, snapshot.calls, list(snapshot.base_versions)

    def _finish(self, check_empty: bool) -> None:
        """Complete this rank's sends and start the next call from an empty pipeline."""
        for transfer in self.state.sends:
            self.p2p.wait(transfer)
        left = [key for key, held in vars(self.state).items() if isinstance(held, dict) and held]
        if check_empty and left:
            raise RuntimeError(f"rank {self.ps.rank}: the pipeline should be empty, but {left} still hold tensors")
        self.state, self.calls = _State(), 0

    def _execute(self, actions: tuple[Action, ...], call: Optional[int], data) -> BatchResult:
        state = self.state
        state.losses, state.loss_parts, state.peak_in_flight = [], [], len(state.saved)
        marks = []  # (action, start, end) on the device clock, when recording a timeline
        pairs = {f: b for b, f in overlap_partners(actions).items()} if self.overlap_pairs else {}
        i = 0
        while i < len(actions):
            if actions[i].kind.is_communication:
                j = i
                while j < len(actions) and actions[j].kind.is_communication:
                    j += 1
                self._post(actions[i:j], state)
                i = j
                continue
            if i in pairs:
                marks += self._run_pair(actions, i, pairs[i], call, data, state)
            if i in pairs or actions[i].overlapped and self.overlap_pairs:  # a backward runs with its forward
                i += 1
                continue
            progress.action(f"{actions[i]} of pipeline call {call}", _phase(actions[i]))
            self._wait_for_inputs(actions[i], state)
            start = self.clock.mark() if self.timeline is not None else None
            with self.streams.alone(_pass_key(actions[i])):
                self._compute(actions[i], call, i, data, state)
            if self.timeline is not None:
                marks.append((actions[i], start, self.clock.mark()))
            i += 1
        if marks:  # read once per call, after the device has run it
            times = self.clock.seconds([mark for _, start, end in marks for mark in (start, end)])
            for k, (action, _, _) in enumerate(marks):
                self.timeline.record(self.ps.pp_rank, action, times[2 * k], times[2 * k + 1])
        state.sends = [t for t in state.sends if not _completed(t)]
        return self.losses_so_far()

    def _run_pair(self, actions: tuple[Action, ...], forward: int, backward: int, call: Optional[int], data,
                  state: "_State") -> list:
        """Run the forward at ``forward`` and the overlapped backward at ``backward`` together; returns their
        timeline marks (the expert all-to-alls go to the timeline as phases of their actions)."""
        progress.action(f"{actions[forward]} with {actions[backward]} of pipeline call {call}", PASSES)
        for index in (forward, backward):
            self._wait_for_inputs(actions[index], state)
        marks = {}

        def timed(index: int):
            def work() -> None:
                start = self.clock.mark() if self.timeline is not None else None
                self._compute(actions[index], call, index, data, state)
                if self.timeline is not None:
                    marks[index] = (actions[index], start, self.clock.mark())
            return work

        def record(is_backward: bool, segment, start: float, end: float) -> None:
            action = actions[backward if is_backward else forward]
            self.timeline.record(self.ps.pp_rank, action, start, end, phase=segment.value)

        with self.streams.pair(_pass_key(actions[forward]), _pass_key(actions[backward])) as (on_forward, on_backward):
            run_pair(timed(forward), timed(backward), record if self.timeline is not None else None, on_forward,
                     on_backward)
        return [marks[index] for index in (forward, backward) if index in marks]

    # ---- communication --------------------------------------------------------------------------
    def _post(self, actions: list[Action], state: "_State") -> None:
        items = []
        for action in actions:
            key = (action.stage, action.microbatch)
            if action.kind is ActionKind.SEND_F:
                items.append((action, state.outputs_to_send.pop(key)))
            elif action.kind is ActionKind.SEND_B:
                items.append((action, state.input_grads.pop(key)))
            else:
                items.append((action, None))
        if not items:
            return
        for transfer in self.p2p.post(items):
            if transfer.action.kind is ActionKind.SEND_F and self.deallocate_sent_outputs:
                _deallocate(dict(items)[transfer.action])
            if transfer.action.kind.is_send:
                state.sends.append(transfer)
            else:
                state.recvs[(transfer.action.kind, transfer.action.stage, transfer.action.microbatch)] = transfer
        state.sends = [t for t in state.sends if not _completed(t)]

    def _wait_for_inputs(self, action: Action, state: "_State") -> None:
        """Wait for what a compute action needs from other ranks (the message it consumes; for
        STEP, the completion of this rank's sends), so the timeline shows the wait as idle."""
        if action.kind is ActionKind.STEP:
            for transfer in state.sends:
                self.p2p.wait(transfer)
            state.sends.clear()
            return
        if not action.kind.is_compute or action.kind is ActionKind.BW:
            return
        kind = ActionKind.RECV_F if action.kind is ActionKind.F else ActionKind.RECV_B
        transfer = state.recvs.get((kind, action.stage, action.microbatch))
        if transfer is not None:
            self.p2p.wait(transfer)

    def _received(self, kind: ActionKind, stage: int, microbatch: int, state: "_State") -> Optional[torch.Tensor]:
        early = state.prereceived.pop((kind, stage, microbatch), None)
        if early is not None:
            return early
        transfer = state.recvs.pop((kind, stage, microbatch), None)
        return None if transfer is None else self.p2p.received(transfer)

    # ---- compute --------------------------------------------------------------------------------
    def _compute(self, action: Action, call: Optional[int], index: int, data, state: "_State") -> None:
        if action.kind is ActionKind.F:
            self._forward(action, call, index, data(action.microbatch), state)
        elif action.kind is ActionKind.B or action.kind is ActionKind.BI:
            self._backward(action.stage, action.microbatch, state, split=action.kind is ActionKind.BI)
        elif action.kind is ActionKind.BW:
            self._weight_backward(action.stage, action.microbatch, state)
        elif action.kind is ActionKind.STEP:
            self._update_stores(self.stores or [], self.step)
        elif action.kind is ActionKind.UPDATE:
            chunk = self.schedule.chunk_of_stage(action.stage)
            upcoming = None if call is None else self.lookahead.next_forward_version(call, index, action.stage)
            self.stores[chunk].update(lambda: self.update(chunk), self._store_version(chunk, upcoming))

    def _update_stores(self, stores: list[WeightVersionStore], step: Callable[[], object]) -> object:
        """Run ``step`` (which updates every chunk) inside each store's update."""
        if not stores:
            return step()
        return stores[0].update(lambda: self._update_stores(stores[1:], step))

    def _store_version(self, chunk: int, version: Optional[int]) -> Optional[int]:
        return None if version is None else self._base_versions[chunk] + version

    def _forward(self, action: Action, call: Optional[int], index: int, batch: dict, state: "_State") -> None:
        stage, microbatch = action.stage, action.microbatch
        key = (stage, microbatch)
        chunk_index = self.schedule.chunk_of_stage(stage)
        if stage == 0:
            inp = None
        else:
            received = self._received(ActionKind.RECV_F, stage, microbatch, state)
            source = received if received is not None else state.local_outputs.pop(key)
            inp = source.detach().requires_grad_(True)
            self.streams.consumed(key, [source])
        self.streams.consumed(key, batch.values())
        use = None
        if self.stores is not None:
            survives = self.program.asynchronous and self.lookahead.updates_before_backward(call, index, stage,
                                                                                            microbatch)
            use = self.stores[chunk_index].forward(self._store_version(chunk_index, action.version), survives)
            self._record(ActionKind.F, stage, microbatch, use.version)
        # an asynchronous pipeline keeps forwards across calls; a checkpoint taken between calls
        # replays them from their input, data and random state (see ``in_flight.py``)
        rng = capture_rng(self.ps.rng_tracker, self.p2p.device) if self.program.asynchronous else None
        out = self._run_forward(stage, microbatch, inp, batch, use, rng, state)
        self.streams.produced(key, [out, *parts_of(out).values()])
        if stage == self.schedule.num_stages - 1:
            state.losses.append(out.detach())
            state.loss_parts.append({name: value.detach() for name, value in parts_of(out).items()})
        elif self.schedule.rank_of(stage + 1, microbatch) == self.ps.pp_rank:
            state.local_outputs[(stage + 1, microbatch)] = out.detach()
        else:
            state.outputs_to_send[key] = out

    def _run_forward(self, stage: int, microbatch: int, inp: Optional[torch.Tensor], batch: dict,
                     use: Optional[VersionUse], rng: Optional[dict], state: "_State") -> torch.Tensor:
        """Run F stage.microbatch and keep what its backward needs; returns the stage's output (the loss
        on the last stage, before scaling)."""
        chunk_index = self.schedule.chunk_of_stage(stage)
        chunk = self.chunks[chunk_index]
        if self.passes is not None:
            self.passes.before_pass(False, chunk_index)
        out = chunk(inp, batch) if use is None or use.weights is None else functional_call(chunk, use.weights,
                                                                                           (inp, batch))
        if self.passes is not None:
            self.passes.after_pass(False, chunk_index)
        graph_end = out
        if stage == self.schedule.num_stages - 1:
            graph_end = self.scale_loss(out / self.program.loss_divisor)
        if self.keeps_graphs:
            state.saved[(stage, microbatch)] = SavedForward(inp, graph_end, use, batch, rng)
        state.peak_in_flight = max(state.peak_in_flight, len(state.saved) + len(state.deferred))
        return out

    def _backward(self, stage: int, microbatch: int, state: "_State", split: bool = False) -> None:
        """B, or with ``split`` BI: the backward with the weight-gradient products left for BW
        (``tensor_parallel/split_backward.py``); the graph is freed either way."""
        key = (stage, microbatch)
        saved = state.saved.pop(key)
        inp, out, use = saved.inp, saved.out, saved.use
        chunk_index = self.schedule.chunk_of_stage(stage)
        if self.passes is not None:
            self.passes.before_pass(True, chunk_index, ActionKind.BI if split else ActionKind.B)
        if stage == self.schedule.num_stages - 1:
            grad = torch.ones_like(out)
        else:
            grad = self._received(ActionKind.RECV_B, stage, microbatch, state)
            if grad is None:
                grad = state.local_grads.pop(key)
            self.streams.consumed(key, [grad])
        if split:
            deferred = state.deferred[key] = []
            with deferring_weight_gradients(deferred):
                _backward_from(out, grad)
        else:
            _backward_from(out, grad)
        if self.passes is not None:
            self.passes.after_pass(True, chunk_index)
        if use is not None:
            self.stores[chunk_index].backward_done(use)
            self._record(ActionKind.B, stage, microbatch, use.version)
        if stage > 0:
            input_grad = inp.grad
            self.streams.produced(key, [input_grad])
            if self.schedule.rank_of(stage - 1, microbatch) == self.ps.pp_rank:
                state.local_grads[(stage - 1, microbatch)] = input_grad
            else:
                state.input_grads[key] = input_grad
        if not split:  # a BI's microbatch keeps its stream for its BW
            self.streams.finished(key)

    def _weight_backward(self, stage: int, microbatch: int, state: "_State") -> None:
        """BW: the weight-gradient products BI left, accumulated like a B's gradients (the
        gradient syncs' hooks see them)."""
        chunk_index = self.schedule.chunk_of_stage(stage)
        if self.passes is not None:
            self.passes.before_pass(True, chunk_index, ActionKind.BW)
        apply_weight_gradients(state.deferred.pop((stage, microbatch)))
        self.streams.finished((stage, microbatch))
        if self.passes is not None:
            self.passes.after_pass(True, chunk_index)

    def _record(self, kind: ActionKind, stage: int, microbatch: int, version: int) -> None:
        if self.versions_used is not None:
            self.versions_used[(kind.value, stage, microbatch)] = version


PASSES, OPTIMIZER = "forward and backward passes", "the optimizer step"


def _phase(action: Action) -> str:
    """What a straggler check counts an action's CPU time towards (``parallel/progress.py``)."""
    return OPTIMIZER if action.kind in (ActionKind.STEP, ActionKind.UPDATE) else PASSES


def _deallocate(output: torch.Tensor) -> None:
    """Free a sent stage output's data but keep its autograd graph (Megatron's
    ``deallocate_output_tensor``): the backward needs only the graph, and the posted send holds
    its own reference to the storage until it completes."""
    if output._base is None:  # a view shares storage another tensor keeps alive anyway
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def _pass_key(action: Action) -> Optional[tuple[int, int]]:
    """(stage, microbatch) of a pass, whose stream it runs on; None for a step or an update."""
    return (action.stage, action.microbatch) if action.kind.is_compute else None


def _backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from ``output`` with ``grad``, also when ``_deallocate`` shrank the output's data
    (``torch.autograd.backward`` would refuse the shapes; the engine itself only needs the graph)."""
    Variable._execution_engine.run_backward((output,), (grad,), False, False, (), True, True)


def _completed(transfer: Transfer) -> bool:
    """True once every handle of a posted send has finished (checked without blocking)."""
    if not transfer.done and all(work.is_completed() for work in transfer.works):
        transfer.done = True
    return transfer.done


@dataclass
class SavedForward:
    """What a forward keeps for its backward, and what replaying it needs (asynchronous schedules)."""

    inp: Optional[torch.Tensor]  # the received boundary tensor (a leaf); None on the first stage
    out: torch.Tensor  # the output (scaled loss on the last stage) to differentiate
    use: Optional[VersionUse]  # the weight version it ran on
    batch: dict  # the microbatch's data
    rng: Optional[dict]  # random states before it ran (asynchronous schedules only)


class _State:
    """Tensors in flight, keyed by (stage, microbatch); carried across calls until the pipeline is empty."""

    def __init__(self):
        self.saved: dict[tuple[int, int], SavedForward] = {}  # kept for the backward, in forward order
        self.deferred: dict = {}  # weight-gradient products a BI left for its BW (``tensor_parallel/split_backward.py``)
        self.prereceived: dict = {}  # (RECV kind, stage, microbatch) -> tensor received before its call
        self.outputs_to_send: dict = {}
        self.input_grads: dict = {}
        self.local_outputs: dict = {}  # handed to the next stage on this same rank
        self.local_grads: dict = {}
        self.recvs: dict = {}
        self.sends: list[Transfer] = []
        self.losses: list = []
        self.loss_parts: list[dict] = []
        self.peak_in_flight = 0
