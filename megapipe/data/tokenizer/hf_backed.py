"""Tokenizers run by the Rust ``tokenizers`` library: GPT-2 BPE, BERT WordPiece, any tokenizer.json."""

from __future__ import annotations

import json
import os
from typing import Callable, Optional, Sequence

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers

from megapipe.data.tokenizer.base import SPECIAL_SPELLINGS, Tokenizer
from megapipe.errors import ConfigError

TOKENIZER_JSON = "tokenizer.json"  # a fast tokenizer's one file
TOKENIZER_CONFIG = "tokenizer_config.json"  # beside it: which of its tokens are special, among others
# The keys of a Hugging Face tokenizer_config.json that declare each special role.
CONFIG_KEYS = {"eod": "eos_token", "cls": "cls_token", "sep": "sep_token", "mask": "mask_token", "pad": "pad_token"}


class HFBackedTokenizer(Tokenizer):
    """Adapts a ``tokenizers.Tokenizer`` to the common interface; special tokens are never added.

    ``save_files(tokenizer, directory)`` writes the files its type is built from (``save``).
    """

    def __init__(self, name: str, rebuild: tuple, backend: Backend,
                 special_ids: dict[str, Optional[int]], lossless: bool,
                 save_files: Callable[["HFBackedTokenizer", str], dict[str, str]]):
        super().__init__(name, rebuild, special_ids)
        self._backend = backend
        self.lossless = lossless
        self._save_files = save_files

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str) -> dict[str, str]:
        return self._save_files(self, directory)

    def hf_backend(self) -> Backend:
        return Backend.from_str(self._backend.to_str())  # a copy: transformers registers special tokens in it


def _find_specials(backend: Backend, declared: dict[str, str]) -> dict[str, Optional[int]]:
    """Id of each special role: the declared spelling if given, else the first known spelling present."""
    found = {}
    for role, spellings in SPECIAL_SPELLINGS.items():
        candidates = (declared[role],) if role in declared else spellings
        found[role] = next((backend.token_to_id(s) for s in candidates if backend.token_to_id(s) is not None), None)
    return found


def gpt2_bpe(vocab_file: str, merge_file: str) -> HFBackedTokenizer:
    """OpenAI's GPT-2 byte-level BPE from its vocab.json (encoder.json) and merges (vocab.bpe) files.

    ``<|endoftext|>`` is an ordinary vocabulary entry here, so text that spells it out round-trips
    unchanged and only an explicit eod id marks a document boundary.
    """
    backend = Backend(models.BPE.from_file(vocab_file, merge_file))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return HFBackedTokenizer("GPT2BPETokenizer", (gpt2_bpe, (vocab_file, merge_file)), backend,
                             {"eod": backend.token_to_id("<|endoftext|>")}, lossless=True, save_files=_save_bpe)


def _save_bpe(tokenizer: HFBackedTokenizer, directory: str) -> dict[str, str]:
    vocab_file, merge_file = tokenizer._backend.model.save(directory)
    return {"tokenizer_type": tokenizer.name, "vocab_file": os.path.basename(vocab_file),
            "merge_file": os.path.basename(merge_file)}


def bert_wordpiece(vocab_file: str, lowercase: bool) -> HFBackedTokenizer:
    """BERT's WordPiece from a vocab.txt (one token per line), lowercasing and stripping accents or not.

    As in Megatron, the end-of-document id is [SEP].
    """
    backend = Backend(models.WordPiece.from_file(vocab_file, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    name = "BertWordPieceLowerCase" if lowercase else "BertWordPieceCase"
    specials = {role: backend.token_to_id(f"[{role.upper()}]") for role in ("cls", "sep", "mask", "pad")}
    specials["eod"] = specials["sep"]
    return HFBackedTokenizer(name, (bert_wordpiece, (vocab_file, lowercase)), backend, specials,
                             lossless=False, save_files=_save_wordpiece)


def _save_wordpiece(tokenizer: HFBackedTokenizer, directory: str) -> dict[str, str]:
    (vocab_file,) = tokenizer._backend.model.save(directory)
    return {"tokenizer_type": tokenizer.name, "vocab_file": os.path.basename(vocab_file)}


def _declared_specials(config_path: str) -> dict[str, str]:
    """Special-token spellings declared in a Hugging Face tokenizer_config.json, if one exists."""
    if not os.path.isfile(config_path):
        return {}
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    declared = {}
    for role, key in CONFIG_KEYS.items():
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            declared[role] = value
    return declared


def huggingface(tokenizer_model: str) -> HFBackedTokenizer:
    """A Hugging Face fast tokenizer: a tokenizer.json, or a directory holding one (read offline).

    Special tokens come from the directory's tokenizer_config.json when present, else from
    their usual spellings in the vocabulary.
    """
    path = tokenizer_model
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_JSON)
        if not os.path.isfile(path):
            raise ConfigError(f"--tokenizer-model {tokenizer_model} is a directory without tokenizer.json; "
                              "point it at a fast tokenizer's folder or use SentencePieceTokenizer for a .model file.")
    try:
        backend = Backend.from_file(path)
    except Exception as error:  # the Rust library raises a bare Exception on malformed files
        raise ConfigError(f"--tokenizer-model {path} is not a valid tokenizer.json ({error}); "
                          "save one with tokenizers' Tokenizer.save or tools/train_tokenizer.py.") from None
    declared = _declared_specials(os.path.join(os.path.dirname(path), TOKENIZER_CONFIG))
    return HFBackedTokenizer("HuggingFaceTokenizer", (huggingface, (tokenizer_model,)), backend,
                             _find_specials(backend, declared), lossless=False, save_files=_save_huggingface)


def _save_huggingface(tokenizer: HFBackedTokenizer, directory: str) -> dict[str, str]:
    """tokenizer.json, and a tokenizer_config.json declaring the special tokens found, so they are found again."""
    tokenizer._backend.save(os.path.join(directory, TOKENIZER_JSON))
    declared = {key: tokenizer._backend.id_to_token(tokenizer.special_id(role)) for role, key in CONFIG_KEYS.items()
                if tokenizer.special_id(role) is not None}
    with open(os.path.join(directory, TOKENIZER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(declared, f, indent=1)
    return {"tokenizer_type": tokenizer.name, "tokenizer_model": TOKENIZER_JSON}
