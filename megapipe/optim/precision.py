"""The optimizer wrapper that owns numerics: fp32 main params, loss scaling, overflow skips, clipping.

Every model parameter has a *main* parameter that the inner torch optimizer updates. For an
fp32 parameter the main parameter is the parameter itself (the wrapper is then a thin layer
over the inner optimizer); for a bf16/fp16 parameter it is an fp32 master copy, stepped in
fp32 from ``main_grad`` and rounded back into the model parameter after each update. One
class serves both, so every precision has the same interface and the same step logic.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from megapipe.errors import CheckpointError
from megapipe.optim.clip import clip_divisor, clip_grads_by_total_norm, count_zero_grads, local_squared_norm
from megapipe.parallel.collectives import all_reduce
from megapipe.optim.grad_buffer import GradBuffers
from megapipe.optim.grad_sync import piece_of
from megapipe.optim.loss_scaler import LossScaler
from megapipe.parallel.state import ParallelState

# Post-validation's hand-over: (overflow flag or None, squared norm) of this stage -> of the stages so far.
StateChain = Callable[[Optional[torch.Tensor], torch.Tensor], tuple[Optional[torch.Tensor], torch.Tensor]]

# Attributes the gradient norm reads; master copies carry them so the norm can run on main params.
NORM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "shared_embedding", "expert_parallel")


def make_main_param(param: torch.nn.Parameter, weight: Optional[torch.Tensor] = None) -> torch.nn.Parameter:
    """What the optimizer steps for ``weight`` (default: all of ``param``; else this rank's piece of it):
    ``param`` itself when it is fp32, an fp32 piece stepped in place, else a detached fp32 master copy,
    carrying ``param``'s parallel attributes."""
    if weight is None and param.dtype == torch.float32:
        return param
    weight = param if weight is None else weight
    master = torch.nn.Parameter(weight.detach() if weight.dtype == torch.float32 else weight.detach().float())
    for name in NORM_ATTRIBUTES:
        if hasattr(param, name):
            setattr(master, name, getattr(param, name))
    return master


class StepResult(NamedTuple):
    """What one optimizer step did, as device tensors (reading them would stall the device queue,
    so the training loop reads them once per log interval); the properties read them now."""

    skipped_flag: torch.Tensor  # bool: the update was skipped (inf/NaN gradient)
    norm: torch.Tensor  # the global gradient norm (inf/NaN when the gradients were)
    overflow_flag: torch.Tensor  # bool: fp16 loss scaling found an overflow (the norm means nothing then)
    zeros: Optional[torch.Tensor] = None  # only with OptimizerConfig.log_num_zeros_in_grad
    amended: bool = False  # post-validation took this eager step back and redid it (a host value, read already)

    @property
    def ok(self) -> bool:
        return not bool(self.skipped_flag)

    @property
    def grad_norm(self) -> Optional[float]:
        """None when an fp16 overflow skipped the step; inf or NaN if only the norm went bad."""
        return None if bool(self.overflow_flag) else float(self.norm)

    @property
    def num_zeros(self) -> Optional[int]:
        return None if self.zeros is None else int(self.zeros)


class PrecisionOptimizer:
    """Steps an inner torch optimizer over main params fed from ``GradBuffers``.

    ``step()`` unscales the gradients (fp16) and checks them for inf/NaN, skips the update if
    any model-parallel rank found one (in every precision: NaN never reaches the weights),
    computes the global norm, clips, updates, and copies masters into low-precision params.

    With a sharded level (``grads.level``) the main params are this rank's pieces of the
    parameters (``GradBuffers.pieces``): the norm and the overflow check also sum over the
    data-parallel group, and the updated pieces are all-gathered by the gradient syncs.
    """

    def __init__(self, inner: torch.optim.Optimizer, model_params: list[torch.nn.Parameter],
                 main_params: list[torch.nn.Parameter], grads: GradBuffers, ps: ParallelState,
                 clip_grad: float, loss_scaler: Optional[LossScaler], log_num_zeros_in_grad: bool = False):
        self.inner = inner
        self.model_params = model_params
        self.main_params = main_params
        self.grads = grads
        self.ps = ps
        self.clip_grad = clip_grad
        self.loss_scaler = loss_scaler
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.sharded = grads.level.shards_optimizer
        if self.sharded:
            self._main_grads = [piece.grad for piece in grads.pieces]
            targets = [piece.weight for piece in grads.pieces]
        else:
            self._main_grads = [model.main_grad for model in model_params]
            targets = model_params
        # (where the updated value goes, master) for every main param that is a copy
        self._copy_back = [(target, main) for target, main in zip(targets, main_params) if main.dtype != target.dtype]
        self._master_pairs = [(model, main) for model, main in zip(model_params, main_params) if model is not main]

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def loss_scale(self) -> Optional[float]:
        """The current fp16 loss scale (read from the device), or None when the loss is not scaled."""
        return float(self.loss_scaler.scale) if self.loss_scaler is not None else None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call ``backward()`` on: the loss times the loss scale (fp16 only)."""
        return loss * self.loss_scaler.scale_on(loss.device) if self.loss_scaler is not None else loss

    @property
    def main_grads(self) -> list[torch.Tensor]:
        """The finalized gradients the step reads, one per main param (views of the gradient buffers)."""
        return self._main_grads

    @torch.no_grad()
    def refresh_model_weights(self) -> None:
        """Make the model's weights those of the main params again (after the main params were set)."""
        self._copy_masters_to_model()
        self.grads.publish_weights()

    def zero_grad(self) -> None:
        """Clear the main gradients before the next batch."""
        self.grads.zero()

    @torch.no_grad()
    def step(self, chain: Optional[StateChain] = None) -> StepResult:
        """Update the parameters from the finalized main gradients, or skip on overflow.

        The overflow flag and the squared gradient norm are all-reduced over the model-parallel
        group. With ``chain`` (optimizer post-validation, ``post_validation.py``) they are reduced
        over this stage's own ranks only and ``chain`` turns them into the state of the stages up
        to this one (every stage on the last), which the step then uses: no collective across
        the pipeline.
        """
        self._attach_main_grads()
        try:
            device = self.grads.device
            whole_model = chain is None
            found = self._unscale_and_find_overflow(whole_model) if self.loss_scaler is not None else None
            squared = local_squared_norm(self.main_params, self.ps, self.sharded)
            self._reduce(squared, whole_model, dist.ReduceOp.SUM)
            if chain is not None:
                found, squared = chain(found, squared)
            overflow = torch.zeros((), dtype=torch.bool, device=device)
            if found is not None:  # without loss scaling, any non-finite gradient makes the norm so
                overflow = found[0] > 0
                self.loss_scaler.update(overflow)
            grad_norm = squared.sqrt()
            skip = overflow | ~torch.isfinite(grad_norm)
            num_zeros = (count_zero_grads(self.main_params, self.ps, self.sharded)
                         if self.log_num_zeros_in_grad else None)
            self._inner_step(skip, grad_norm if self.clip_grad > 0 else None)
            self._copy_masters_to_model()  # a skipped update left the masters as they were
            self.grads.publish_weights()
            return StepResult(skip, grad_norm, overflow, num_zeros)
        finally:
            # main.grad aliases the buffer for fp32 params; never let autograd accumulate into it.
            for main in self.main_params:
                main.grad = None

    def _reduce(self, tensor: torch.Tensor, whole_model: bool, op) -> None:
        """Reduce over the model-parallel group (``whole_model``) or this stage's tensor group, and
        over the data-parallel group when each replica holds a piece of the gradients."""
        if whole_model:
            all_reduce(tensor, self.ps.mp_group, self.ps.tp_size * self.ps.pp_size, op=op)
        else:
            all_reduce(tensor, self.ps.tp_group, self.ps.tp_size, op=op)
        if self.sharded:
            all_reduce(tensor, self.ps.dp_cp_group, self.ps.dp_cp_size, op=op)

    def _inner_step(self, skip: torch.Tensor, clip_by: Optional[torch.Tensor]) -> None:
        """Clip by the norm ``clip_by`` (None: no clipping) and update unless ``skip``. Torch's fused kernels
        take both on the device, as its gradient scaler passes them (``found_inf``, and ``grad_scale``, which
        they divide each gradient by as they read it), so no step reads the flag and clipping costs no pass;
        other kernels get the gradients scaled first and need the flag on the host."""
        if self.inner.defaults.get("fused"):
            self.inner.found_inf = skip.float()
            self.inner.grad_scale = clip_divisor(self.clip_grad, clip_by) if clip_by is not None else None
            self.inner.step()
            return
        if clip_by is not None:
            clip_grads_by_total_norm(self.main_params, self.clip_grad, clip_by)
        if not bool(skip):
            self.inner.step()

    def _attach_main_grads(self) -> None:
        for grad, main in zip(self._main_grads, self.main_params):
            main.grad = grad if grad.dtype == main.dtype else grad.to(main.dtype)

    def _unscale_and_find_overflow(self, whole_model: bool = True) -> torch.Tensor:
        """Divide gradients by the loss scale; a 1-element tensor above 0 if any rank of the model
        (``whole_model``) or of this stage saw inf or NaN.

        Every gradient is checked, including copies the norm leaves out (tensor-parallel
        duplicates, the last stage's embedding copy), so no rank can step on a bad gradient.
        """
        grads = [main.grad for main in self.main_params]
        device = self.grads.device
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inverse_scale = self.loss_scaler.scale_on(device).reciprocal().reshape(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse_scale)
        all_reduce(found, self.ps.ep_group, self.ps.ep_size, op=dist.ReduceOp.MAX)  # other ranks' experts
        self._reduce(found, whole_model, dist.ReduceOp.MAX)
        return found

    def _copy_masters_to_model(self) -> None:
        if self._copy_back:
            targets, mains = zip(*self._copy_back)
            torch._foreach_copy_(list(targets), list(mains))

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Inner optimizer state, fp32 masters and loss scaler: everything an exact resume needs."""
        return {
            "optimizer": self.inner.state_dict(),
            "masters": [main for _, main in self._master_pairs],
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; the model params are set from the restored masters."""
        masters = state["masters"]
        if len(masters) != len(self._master_pairs):
            raise CheckpointError(f"the checkpoint holds {len(masters)} fp32 master params but this model has "
                                  f"{len(self._master_pairs)}; load it with the same --fp16/--bf16 setting.")
        if (state["loss_scaler"] is None) != (self.loss_scaler is None):
            raise CheckpointError("the checkpoint's loss scaling does not match this run; "
                                  "resume with the same --fp16/--bf16 setting.")
        self.inner.load_state_dict(state["optimizer"])
        for (_, main), saved in zip(self._master_pairs, masters):
            main.copy_(saved)
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.refresh_model_weights()

    # ---- whole-parameter view of the state (checkpoints in any layout) ----------------------------
    def param_states(self) -> dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Per model parameter (by ``id``): its fp32 main weight and optimizer state, each shaped like
        the parameter. Collective over the data-parallel group when the optimizer is sharded."""
        if not self.sharded:
            return {id(model): (main, dict(self.inner.state.get(main, {})))
                    for model, main in zip(self.model_params, self.main_params)}
        whole_mains = self.grads.gather_full([main.detach() for main in self.main_params])
        states: dict[int, dict[str, torch.Tensor]] = {key: {} for key in whole_mains}
        for name, step in self._state_names().items():
            if step is not None:  # a step count: the same for every piece and every rank
                for key in states:
                    states[key][name] = torch.tensor(step, dtype=torch.float32)
                continue
            whole = self.grads.gather_full([self.inner.state[main][name] for main in self.main_params])
            for key, tensor in whole.items():
                states[key][name] = tensor
        return {key: (whole_mains[key], states[key]) for key in whole_mains}

    def _state_names(self) -> dict[str, Optional[float]]:
        """The optimizer state's names (a step count's value, None for a tensor per piece), agreed
        over the data-parallel group: a rank whose shard holds only padding has no state of its own
        and must still join every gather."""
        first = self.inner.state.get(self.main_params[0], {}) if self.main_params else {}
        mine = {name: float(value) if value.dim() == 0 else None for name, value in first.items()}
        everyone: list = [None] * self.ps.dp_cp_size
        dist.all_gather_object(everyone, mine, group=self.ps.dp_cp_group)
        return next((names for names in everyone if names), {})

    @torch.no_grad()
    def load_param_states(self, states: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restore optimizer state given whole per-parameter tensors (by ``id`` of the model param)."""
        index = {id(p): i for i, p in enumerate(p for group in self.inner.param_groups for p in group["params"])}
        pieces = self.grads.pieces if self.sharded else [None] * len(self.main_params)
        saved = {}
        for model, main, piece in zip(self.model_params, self.main_params, pieces):
            values = states.get(id(model))
            if values:
                saved[index[id(main)]] = {name: value if piece is None or value.dim() == 0
                                          else piece_of(piece, value).clone()
                                          for name, value in values.items()}
        state = self.inner.state_dict()
        state["state"] = saved
        self.inner.load_state_dict(state)

    @torch.no_grad()
    def load_main_weights(self, weights: dict[int, torch.Tensor]) -> None:
        """Set the main weights (fp32 masters or pieces) from whole fp32 values by model-param ``id``;
        the model's own weights must already hold them (or be gathered from them next)."""
        pieces = self.grads.pieces if self.sharded else [None] * len(self.main_params)
        for model, main, piece in zip(self.model_params, self.main_params, pieces):
            if main is not model and id(model) in weights:
                whole = weights[id(model)]
                main.copy_(whole if piece is None else piece_of(piece, whole))
        self.refresh_model_weights()
