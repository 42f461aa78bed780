"""GPT, BERT and Llama built per pipeline stage, tensor-parallel inside each stage.

Each model family's stage class comes from its registry entry (``megapipe.models.families``);
``MODEL_KINDS`` maps a training script's kind to the stage class its family builds. Under the
``compile`` fusion backend each transformer layer is compiled once built (``compiled_layers.py``);
``split_backward`` says the schedule will split its backwards (BI and BW), which that must know.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megapipe import fusions
from megapipe.config import ModelConfig
from megapipe.models.families import KINDS, kind_family
from megapipe.layout.stage_plan import equal_split
from megapipe.models.compiled_layers import compile_layers
from megapipe.models.stage import LanguageModelStage
from megapipe.parallel.state import ParallelState

MODEL_KINDS = {kind: kind_family(kind).stage for kind in KINDS}


def build_model_chunks(kind: str, config: ModelConfig, ps: ParallelState,
                       layer_ranges: Optional[Sequence[tuple[int, int]]] = None, seed: int = 1234,
                       sequence_parallel: bool = False, device=None,
                       split_backward: bool = False) -> list[LanguageModelStage]:
    """The model chunks this rank holds, in chunk order: chunk c holds the layers ``layer_ranges[s]`` of
    stage ``s = ps.chunk_stages()[c]``. ``layer_ranges`` gives every (virtual) stage's layers, in stage order
    (a stage plan's, or ``RunPlan.layer_ranges``); None splits the layers equally over the stages.

    With v chunks per rank rank r holds virtual stages r, r + p, r + 2p, ... (looped, Megatron's
    layout) or r and 2p - 1 - r (V); the first stage has the embedding and the last the head.
    """
    if layer_ranges is None:
        config.validate(ps.tp_size, ps.pp_size, ps.virtual_pipeline)
        layer_ranges = equal_split(config.num_layers, ps.virtual_stages).layer_ranges
    else:
        config.validate(ps.tp_size)  # stages need not hold equal numbers of layers
    stage_cls, last = MODEL_KINDS[kind], len(layer_ranges) - 1
    chunks = [stage_cls(config, ps, *layer_ranges[stage], pre_process=stage == 0, post_process=stage == last,
                        seed=seed, sequence_parallel=sequence_parallel, device=device)
              for stage in ps.chunk_stages()]
    return _compiled_if_asked(chunks, split_backward)


def _compiled_if_asked(chunks: list[LanguageModelStage], split_backward: bool) -> list[LanguageModelStage]:
    """``chunks``, their layers compiled under the ``compile`` fusion backend (their weights in place)."""
    if fusions.active_backend().name == "compile":
        compile_layers(chunks, split_backward)
    return chunks
