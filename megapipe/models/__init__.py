"""GPT, BERT and Llama built per pipeline stage, tensor-parallel inside each stage.

Each model family's stage class comes from its registry entry (``megapipe.models.families``);
``MODEL_KINDS`` maps a training script's kind to the stage class its family builds. Under the
``compile`` fusion backend each transformer layer is compiled once built (``compiled_layers.py``);
``split_backward`` says the schedule will split its backwards (BI and BW), which that must know.
"""

from __future__ import annotations

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.models.families import KINDS, kind_family
from megapipe.layout.stage_plan import equal_split
from megapipe.models.compiled_layers import compile_layers
from megapipe.models.stage import LanguageModelStage
from megapipe.parallel.state import ParallelState

MODEL_KINDS = {kind: kind_family(kind).stage for kind in KINDS}


def build_model_chunks(kind: str, config: ModelConfig, ps: ParallelState, seed: int = 1234,
                       sequence_parallel: bool = False, device=None,
                       split_backward: bool = False) -> list[LanguageModelStage]:
    """The model chunks this rank holds: one per virtual stage, in chunk order; chunk c holds the layers
    of virtual stage ``ps.chunk_stages()[c]``.

    With v chunks per rank rank r holds virtual stages r, r + p, r + 2p, ... (looped, Megatron's
    layout) or r and 2p - 1 - r (V); the first stage has the embedding and the last the head.
    """
    config.validate(ps.tp_size, ps.pp_size, ps.virtual_pipeline)
    stage_cls = MODEL_KINDS[kind]
    num_stages = ps.pp_size * ps.virtual_pipeline
    chunks, ranges = [], equal_split(config.num_layers, num_stages).layer_ranges
    for stage in ps.chunk_stages():
        start, end = ranges[stage]
        chunks.append(stage_cls(config, ps, start, end, pre_process=stage == 0, post_process=stage == num_stages - 1,
                                seed=seed, sequence_parallel=sequence_parallel, device=device))
    return _compiled_if_asked(chunks, split_backward)


def build_planned_stage(kind: str, config: ModelConfig, ps: ParallelState, layer_ranges: list[tuple[int, int]],
                        seed: int = 1234, sequence_parallel: bool = False, device=None,
                        split_backward: bool = False) -> list[LanguageModelStage]:
    """The one chunk of this rank's stage when stage i holds layers ``layer_ranges[i]`` (a stage plan,
    ``megapipe.layout.stage_plan``), whatever the split: stages need not hold equal numbers of layers."""
    config.validate(ps.tp_size)
    stage = ps.pipeline_stage
    start, end = layer_ranges[stage]
    return _compiled_if_asked([MODEL_KINDS[kind](config, ps, start, end, pre_process=stage == 0,
                                                 post_process=stage == len(layer_ranges) - 1, seed=seed,
                                                 sequence_parallel=sequence_parallel, device=device)],
                              split_backward)


def _compiled_if_asked(chunks: list[LanguageModelStage], split_backward: bool) -> list[LanguageModelStage]:
    """``chunks``, their layers compiled under the ``compile`` fusion backend (their weights in place)."""
    if fusions.active_backend().name == "compile":
        compile_layers(chunks, split_backward)
    return chunks
