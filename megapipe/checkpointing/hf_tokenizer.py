"""A megapipe tokenizer as Hugging Face files that ``AutoTokenizer.from_pretrained`` loads, and the
special-token ids an exported ``config.json`` must name to match it."""

from __future__ import annotations

from typing import Optional

from megapipe.data.tokenizer import Tokenizer
from megapipe.data.tokenizer.hf_backed import CONFIG_KEYS

# transformers' special-token names -> the megapipe role each is; GPT-style models begin a text with
# the end-of-document token too, as GPT-2 does with <|endoftext|>.
HF_SPECIAL_TOKENS = {"bos_token": "eod", **{key: role for role, key in CONFIG_KEYS.items()}}
CONFIG_TOKENS = ("bos_token", "eos_token", "pad_token")  # those config.json names by id


def config_token_ids(tokenizer: Optional[Tokenizer]) -> dict[str, Optional[int]]:
    """bos/eos/pad ids for config.json: the tokenizer's special tokens; None without a tokenizer (the
    architecture's defaults, such as GPT-2's 50256, may lie outside a megapipe vocabulary)."""
    return {f"{name}_id": tokenizer.special_id(HF_SPECIAL_TOKENS[name]) if tokenizer is not None else None
            for name in CONFIG_TOKENS}


def save_hf_tokenizer(tokenizer: Tokenizer, hf_dir: str) -> None:
    """tokenizer.json and tokenizer_config.json of a fast tokenizer that encodes as ``tokenizer`` does,
    with its special tokens declared under transformers' names."""
    import transformers

    backend = tokenizer.hf_backend()
    special = {name: backend.id_to_token(tokenizer.special_id(role)) for name, role in HF_SPECIAL_TOKENS.items()
               if tokenizer.special_id(role) is not None}
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **special).save_pretrained(hf_dir)
