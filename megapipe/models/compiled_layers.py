"""Regional compilation: each transformer layer compiled by torch.compile on its own (``--fusion-backend compile``).

A layer is the region: big enough for the compiler to fuse every elementwise op, norm and dropout-add into
its neighbours and to choose what the backward recomputes, small enough to compile in seconds, and the same
code for every layer of a stage. Modules are traced inline (dynamo's default from torch 2.5 on, the only mode
in 2.13), so parameters are inputs of the graph rather than constants: layers of one structure share one
compiled graph, and weights that change after compilation (loaded checkpoints, optimizer steps, stashed
versions) need no recompilation. ``dynamic=None``: a training run has one shape, which is compiled
specialised (the best kernels); a second shape (evaluation's batch, a shorter last batch) makes dynamo
recompile once with symbolic sizes instead of once per shape.

What the layer calls knows it is being traced (``torch.compiler.is_compiling()``): the fused ops take
PyTorch's plain kernels, which the compiler fuses itself (``fusions/backend.py``); ``linear`` is ``F.linear``,
whose weight gradient the compiled backward computes; selective recomputation leaves the choice of what to
recompute to the compiler's partitioner; and with one tensor rank dropout draws from the default generator
rather than swapping in the tensor-parallel stream. The forward and backward of GPT, BERT and Llama layers
are then one graph each.

A schedule that splits backwards (the zero-bubble and V schedules) defers each linear's weight-gradient
product from BI to BW (``tensor_parallel/split_backward.py``), which a compiled backward cannot do: its graph
computes every gradient at once. There the parallel linears stay outside the compiled graphs, and the pieces
between them (norms, attention, activations, dropout-adds) are compiled, each piece's backward too.

MoE layers are refused at flag-checking time (``check_compiled_layers``): their products read each expert's
token count on the host, which breaks the graph at every layer.
"""

from __future__ import annotations

import functools
from typing import Callable, Union

import torch
from torch import nn

from megapipe.errors import ConfigError, first_line
from megapipe.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def check_compiled_layers(fusion_backend: str, num_experts: int | None) -> None:
    """Refuse, in one sentence, what regional compilation cannot do."""
    if fusion_backend == "compile" and num_experts is not None:
        raise ConfigError("--fusion-backend compile cannot compile MoE layers: their expert products read each "
                          "expert's token count on the host, which breaks the compiled graph at every layer; use "
                          "--fusion-backend auto, triton or eager with --num-experts.")


def compile_layers(chunks: list[nn.Module], split_backward: bool = False,
                   backend: Union[str, Callable] = "inductor") -> None:
    """Compile every transformer layer of ``chunks`` in place (parameter names and state dicts unchanged).

    ``split_backward``: the schedule splits backwards into BI and BW, so the parallel linears run outside the
    compiled graphs. ``backend``: torch.compile's (a name, such as "aot_eager", which traces without generating code, or a
    compiler function)."""
    for chunk in chunks:
        for layer in chunk.layers.values():
            if split_backward:
                for module in layer.modules():
                    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                        module.forward = torch.compiler.disable(module.forward)
            compiled = torch.compile(layer.forward, backend=backend, dynamic=None)
            layer.forward = functools.partial(_run_compiled, compiled, layer.layer_number)


def _run_compiled(compiled, layer_number: int, *args, **kwargs):
    """The compiled layer's forward; a compilation that fails is refused in one sentence."""
    try:
        return compiled(*args, **kwargs)
    except torch._dynamo.exc.BackendCompilerFailed as error:  # a C++ or Triton build, a lowering; not the layer's code
        raise ConfigError(f"--fusion-backend compile failed to compile transformer layer {layer_number} "
                          f"({first_line(error.inner_exception)}); use --fusion-backend triton or eager.") from error
