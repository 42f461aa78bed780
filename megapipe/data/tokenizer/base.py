"""The interface every tokenizer offers, whatever library is behind it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

from megapipe.errors import ConfigError

# Roles a special token can play, with the advice given when a tokenizer lacks one.
SPECIAL_ROLES = {
    "eod": "an end-of-document token; train the tokenizer with one (e.g. <|endoftext|> or </s>) "
           "or preprocess without --append-eod",
    "cls": "a [CLS] token, which BERT needs; use --tokenizer-type BertWordPieceLowerCase, "
           "BertWordPieceCase or ByteLevelTokenizer",
    "sep": "a [SEP] token, which BERT needs; use --tokenizer-type BertWordPieceLowerCase, "
           "BertWordPieceCase or ByteLevelTokenizer",
    "mask": "a [MASK] token, which BERT needs; use --tokenizer-type BertWordPieceLowerCase, "
            "BertWordPieceCase or ByteLevelTokenizer",
    "pad": "a [PAD] token, which BERT needs; use --tokenizer-type BertWordPieceLowerCase, "
           "BertWordPieceCase or ByteLevelTokenizer",
}

# Spellings of each special token in common vocabularies, most likely first.
SPECIAL_SPELLINGS = {
    "eod": ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<eod>", "[SEP]"),
    "cls": ("[CLS]", "<s>", "<cls>"),
    "sep": ("[SEP]", "</s>", "<sep>"),
    "mask": ("[MASK]", "<mask>"),
    "pad": ("[PAD]", "<pad>"),
}


class Tokenizer(ABC):
    """Text <-> token ids, plus the ids of the special tokens GPT and BERT need.

    ``lossless`` says whether ``detokenize(tokenize(text)) == text`` holds for every string.
    A tokenizer pickles as the arguments that built it, so worker processes rebuild it from
    its files instead of receiving a copy of its tables.
    """

    lossless: bool = False

    def __init__(self, name: str, rebuild: tuple, special_ids: dict[str, Optional[int]]):
        """``rebuild``: (a module-level function, its arguments) that makes this tokenizer again, which is
        how it is pickled (worker processes of the data loaders receive the recipe, not the tables)."""
        self.name = name
        self._rebuild = rebuild
        self._special_ids = {role: special_ids.get(role) for role in SPECIAL_ROLES}

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (ids run from 0 to vocab_size - 1)."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``; adds no special tokens (except Llama2Tokenizer's leading bos, as Megatron's)."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of the token ids ``ids``."""

    @abstractmethod
    def save(self, directory: str) -> Optional[dict[str, str]]:
        """Write the files that rebuild this tokenizer into the existing ``directory`` and return the
        ``build_tokenizer`` keyword arguments that load them, paths relative to ``directory``
        (None for a tokenizer that reads no text), so a checkpoint carries the tokenizer of its run."""

    def hf_backend(self):
        """A ``tokenizers.Tokenizer`` that encodes text to the same ids, for Hugging Face exports."""
        raise ConfigError(f"{self.name} has no Hugging Face equivalent; train with a text tokenizer "
                          "(--tokenizer-type) to export one.")

    def special_id(self, role: str) -> Optional[int]:
        """The id of the special token playing ``role`` (a key of SPECIAL_ROLES), or None when there is none."""
        return self._special_ids[role]

    def _special(self, role: str) -> int:
        token_id = self._special_ids[role]
        if token_id is None:
            raise ConfigError(f"{self.name} lacks {SPECIAL_ROLES[role]}.")
        return token_id

    @property
    def eod(self) -> int:
        return self._special("eod")

    @property
    def cls(self) -> int:
        return self._special("cls")

    @property
    def sep(self) -> int:
        return self._special("sep")

    @property
    def mask(self) -> int:
        return self._special("mask")

    @property
    def pad(self) -> int:
        return self._special("pad")

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of every special token this tokenizer has (BERT never masks or samples these)."""
        return frozenset(i for i in self._special_ids.values() if i is not None)

    def __reduce__(self):
        return self._rebuild

    def __repr__(self) -> str:
        return f"{self.name}(vocab_size={self.vocab_size})"
