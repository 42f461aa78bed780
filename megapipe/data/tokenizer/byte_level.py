"""A tokenizer with no files: one id per UTF-8 byte, then the special tokens."""

from __future__ import annotations

from typing import Sequence

from megapipe.data.tokenizer.base import SPECIAL_SPELLINGS, Tokenizer

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

    def save(self, directory: str) -> dict[str, str]:
        return {"tokenizer_type": self.name}  # no files: the type says everything

    def hf_backend(self):
        """Byte-level BPE without merges: GPT-2's byte-to-character map sends byte ``b`` to id ``b``, and the
        special tokens take their usual spellings (``<|endoftext|>``, ``[CLS]`` ...) at ids 256-260."""
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        vocab = {char: byte for byte, char in bytes_to_unicode().items()}
        vocab.update({SPECIAL_SPELLINGS[role][0]: 256 + i for i, role in enumerate(SPECIAL_TOKENS)})
        backend = Backend(models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        return backend
