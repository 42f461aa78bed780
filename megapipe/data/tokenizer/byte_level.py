"""A tokenizer with no files: one id per UTF-8 byte, then the special tokens."""

from __future__ import annotations

from typing import Sequence

from megapipe.data.tokenizer.base import Tokenizer

SPECIAL_TOKENS = ("eod", "cls", "sep", "mask", "pad")


class ByteLevelTokenizer(Tokenizer):
    """Ids 0-255 are the bytes of the UTF-8 text; 256-260 are eod, [CLS], [SEP], [MASK], [PAD].

    Lossless for every string. ``detokenize`` drops special tokens and replaces byte sequences
    that are not valid UTF-8 (which only a model's output can contain) with U+FFFD.
    """

    lossless = True

    def __init__(self):
        super().__init__("ByteLevelTokenizer", (ByteLevelTokenizer, ()),
                         {role: 256 + i for i, role in enumerate(SPECIAL_TOKENS)})

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")
