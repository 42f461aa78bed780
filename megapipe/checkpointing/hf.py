"""Hugging Face directories (``save_pretrained`` output) <-> canonical megapipe tensors.

GPT-2 (``GPT2LMHeadModel``), BERT (``BertForPreTraining``), the Llama family
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``) and the MoE family (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE: read through ``from_pretrained``, whose in-memory expert layout the
mapping follows). Llama-family safetensors
(single or sharded with an index) are read tensor by tensor; other weights go through
``from_pretrained`` (safetensors or ``.bin``, sharded or not). Import refuses what megapipe
cannot compute identically: other architectures, and options that change the maths. Export
writes ``config.json`` and safetensors through ``save_pretrained`` of a model that received
every weight, so what it writes is exactly what ``from_pretrained`` loads. The tokenizer travels
with the weights both ways: an import keeps the directory's ``tokenizer.json`` (else its
SentencePiece ``tokenizer.model``); an export writes the checkpoint's tokenizer as files
``AutoTokenizer`` loads, and names its special tokens in ``config.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from megapipe.config import ModelConfig
from megapipe.errors import CheckpointError
from megapipe.checkpointing.hf_tokenizer import config_token_ids, save_hf_tokenizer
from megapipe.checkpointing.safetensors_files import SafetensorsFiles, has_safetensors
from megapipe.data.tokenizer import Tokenizer, build_tokenizer
from megapipe.data.tokenizer.hf_backed import TOKENIZER_JSON
from megapipe.data.tokenizer.sentencepiece_model import MODEL_FILE as SENTENCEPIECE_FILE
from megapipe.models.families import HF_ARCHITECTURES, HFArchitecture, family_of


@dataclass(frozen=True)
class Architecture:
    """A Hugging Face architecture (the model families' entries) and the megapipe kind it trains as."""

    kind: str  # megapipe's model kind
    hf: HFArchitecture

    def __getattr__(self, name):  # hf_class, model_config, weights, hf_config, unsupported ...
        return getattr(self.hf, name)


ARCHITECTURES = {model_type: Architecture(family.kind, arch) for model_type, (family, arch) in HF_ARCHITECTURES.items()}
SUPPORTED = ", ".join(f"{arch.hf_class} ({name!r})" for name, arch in ARCHITECTURES.items())
# The pretraining heads of BertForPreTraining that an encoder-only BertModel lacks.
BERT_HEADS = {"cls.predictions": "masked-LM head", "cls.seq_relationship": "sentence-order (binary) head"}


def _architecture(hf_dir: str) -> tuple[str, Architecture]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model directory: it has no config.json.")
    with open(path) as f:
        fields = json.load(f)
    model_type = fields.get("model_type")
    if model_type not in ARCHITECTURES:
        names = ", ".join(fields.get("architectures") or []) or "no architectures listed"
        raise CheckpointError(f"{hf_dir} holds a {model_type!r} model ({names}), which cannot be imported; "
                              f"supported: {SUPPORTED}.")
    return model_type, ARCHITECTURES[model_type]


def _check_options(model_type: str, hf_config, hf_dir: str) -> None:
    for option, expected in ARCHITECTURES[model_type].unsupported.items():
        if getattr(hf_config, option, expected) != expected:
            raise CheckpointError(f"{hf_dir}: {model_type} with {option}={getattr(hf_config, option)!r} is not "
                                  f"supported; megapipe computes {option}={expected!r}.")
    position = getattr(hf_config, "position_embedding_type", None)
    if model_type == "bert" and position not in (None, "absolute"):
        raise CheckpointError(f"{hf_dir}: BERT with position_embedding_type={position!r} is not supported; "
                              "megapipe uses absolute position embeddings.")


def hf_dir_tokenizer(hf_dir: str) -> Tokenizer | None:
    """The tokenizer of a Hugging Face directory: its ``tokenizer.json``, else its ``tokenizer.model``, or None."""
    if os.path.isfile(os.path.join(hf_dir, TOKENIZER_JSON)):
        return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    if os.path.isfile(os.path.join(hf_dir, SENTENCEPIECE_FILE)):
        return build_tokenizer("SentencePieceTokenizer", tokenizer_model=os.path.join(hf_dir, SENTENCEPIECE_FILE))
    return None


@dataclass
class Imported:
    """What an import produced: the model and where it came from."""

    kind: str
    model_type: str  # Hugging Face's model_type, kept so export writes the same architecture
    config: ModelConfig
    canonical: dict
    tokenizer: Tokenizer | None
    initialized_heads: list  # pretraining heads that were missing and freshly initialised


def import_hf(hf_dir: str, initialize_missing_heads: bool = False) -> Imported:
    """The megapipe model of a Hugging Face directory.

    ``initialize_missing_heads``: a BERT encoder saved without its pretraining heads (a
    ``BertModel``) gets freshly initialised masked-LM and sentence-order heads instead of an error.
    """
    import transformers

    model_type, arch = _architecture(hf_dir)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
    _check_options(model_type, hf_config, hf_dir)
    try:
        config = arch.model_config(hf_config)
    except ValueError as error:
        raise CheckpointError(f"{hf_dir}: {error}.") from None
    tokenizer = hf_dir_tokenizer(hf_dir)
    if arch.reads_safetensors and has_safetensors(hf_dir):
        canonical = arch.weights.from_hf(SafetensorsFiles(hf_dir), config)
        return Imported(arch.kind, model_type, config, canonical, tokenizer, [])
    try:
        model, info = getattr(transformers, arch.hf_class).from_pretrained(hf_dir, output_loading_info=True,
                                                                           dtype=torch.float32)
    except (OSError, ValueError) as error:
        reason = str(error).splitlines()[0].rstrip(".")
        raise CheckpointError(f"{hf_dir}: the weights cannot be read ({reason}).") from None
    missing = sorted(info["missing_keys"])
    heads = sorted({label for prefix, label in BERT_HEADS.items() for key in missing if key.startswith(prefix)})
    if missing and not (initialize_missing_heads and model_type == "bert"
                        and all(key.startswith(tuple(BERT_HEADS)) for key in missing)):
        hint = (" or pass --initialize-missing-heads to start the " + " and ".join(heads) + " from random weights"
                if model_type == "bert" and heads else "")
        raise CheckpointError(f"{hf_dir} lacks {len(missing)} weights a {arch.hf_class} needs (first: {missing[0]}); "
                              f"it was probably saved from a model without the pretraining heads: import a "
                              f"checkpoint that has them{hint}.")
    return Imported(arch.kind, model_type, config, arch.weights.from_hf(model.state_dict(), config), tokenizer, heads)


def hf_model_type(kind: str, config: ModelConfig, remembered: str | None) -> str:
    """The Hugging Face architecture to export as: the imported one, else the one its model family exports as."""
    if remembered in ARCHITECTURES:
        return remembered
    return family_of(kind, config).hf_export_type(config)


def hf_config_of(kind: str, config: ModelConfig, model_type: str | None = None, **token_ids):
    """The transformers config of a megapipe model with ``token_ids`` (bos_token_id ...), or CheckpointError
    when Hugging Face has no equal."""
    model_type = model_type or hf_model_type(kind, config, None)
    try:
        return ARCHITECTURES[model_type].hf_config(config, **token_ids)
    except ValueError as error:
        raise CheckpointError(f"cannot export as {model_type}: {error}.") from None


def export_hf(kind: str, config: ModelConfig, canonical: dict[str, torch.Tensor], hf_dir: str,
              model_type: str | None = None, tokenizer: Tokenizer | None = None, max_shard_size: str = "5GB") -> None:
    """Write ``canonical`` (megapipe names, whole tensors) as a Hugging Face directory of ``model_type``
    (by default the architecture the options match), with ``tokenizer``'s files and special-token ids."""
    import transformers

    model_type = hf_model_type(kind, config, model_type)
    arch = ARCHITECTURES[model_type]
    hf_config = hf_config_of(kind, config, model_type, **config_token_ids(tokenizer))
    model = getattr(transformers, arch.hf_class)(hf_config)
    state = {key: value.float() for key, value in arch.weights.to_hf(canonical, config).items()}
    model.load_state_dict(state, strict=True)
    model.save_pretrained(hf_dir, max_shard_size=max_shard_size)
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, hf_dir)
