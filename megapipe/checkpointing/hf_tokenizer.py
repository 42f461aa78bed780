"""A megapipe tokenizer as Hugging Face files that ``AutoTokenizer.from_pretrained`` loads, and the
special-token ids an exported ``config.json`` must name to match it."""

from __future__ import annotations

from typing import Optional

from megapipe.data.tokenizer import Tokenizer
from megapipe.data.tokenizer.hf_backed import CONFIG_KEYS

# config.json's token ids -> the megapipe role each names: GPT-style models begin and end a text
# with the end-of-document token, as GPT-2's <|endoftext|> does.
CONFIG_IDS = {"bos_token_id": "eod", "eos_token_id": "eod", "pad_token_id": "pad"}


def config_token_ids(tokenizer: Optional[Tokenizer]) -> dict[str, Optional[int]]:
    """bos/eos/pad ids for config.json: the tokenizer's special tokens; None without a tokenizer (the
    architecture's defaults, such as GPT-2's 50256, may lie outside a megapipe vocabulary)."""
    return {name: tokenizer.special_id(role) if tokenizer is not None else None for name, role in CONFIG_IDS.items()}


def save_hf_tokenizer(tokenizer: Tokenizer, hf_dir: str) -> None:
    """tokenizer.json and tokenizer_config.json of a fast tokenizer that encodes as ``tokenizer`` does,
    its special tokens declared under transformers' names (eos, bos, pad, cls, sep, mask)."""
    import transformers

    backend = tokenizer.hf_backend()
    spelled = {key.removesuffix("_token"): backend.id_to_token(tokenizer.special_id(role))
               for role, key in CONFIG_KEYS.items() if tokenizer.special_id(role) is not None}
    if "eos" in spelled:
        spelled["bos"] = spelled["eos"]
    special = {f"{name}_token": spelling for name, spelling in spelled.items()}
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **special).save_pretrained(hf_dir)
