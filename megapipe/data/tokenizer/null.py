"""Megatron's ``NullTokenizer``: the text is the token ids, written as decimal numbers between whitespace.

``--vocab-size N`` gives ids 0 to N-1 for the text and one more, id N, as the end of document
(so ``vocab_size`` is N + 1), as Megatron-LM's ``_NullTokenizer``. It reads no files, so a
checkpoint stores only its type and N. ``--mock-data`` uses it too.
"""

from __future__ import annotations

from typing import Sequence

from megapipe.data.tokenizer.base import Tokenizer
from megapipe.errors import DataError


class NullTokenizer(Tokenizer):
    """Ids are written as decimal numbers separated by whitespace; id ``vocab_size`` (the argument) is eod."""

    lossless = False  # any whitespace between the numbers comes back as one space

    def __init__(self, vocab_size: int):
        super().__init__("NullTokenizer", (NullTokenizer, (vocab_size,)), {"eod": vocab_size})
        self._size = vocab_size + 1

    @property
    def vocab_size(self) -> int:
        return self._size

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if not (word.isdecimal() and int(word) < self._size - 1):
                raise DataError(f"NullTokenizer reads token ids 0 to {self._size - 2} written as decimal numbers "
                                f"between whitespace, not {word[:40]!r}; tokenize the text with a text tokenizer "
                                "(--tokenizer-type) or raise --vocab-size.")
            ids.append(int(word))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def hf_backend(self):
        """A word-level ``tokenizers.Tokenizer`` whose words are the decimal ids, split at whitespace."""
        from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers

        backend = Backend(models.WordLevel({str(i): i for i in range(self._size)}))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
        return backend

    def save(self, directory: str) -> dict:
        return {"tokenizer_type": self.name, "vocab_size": self._size - 1}  # no files: N says everything
