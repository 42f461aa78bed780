"""SentencePiece models (.model files), as used by Llama, Mistral and T5, under Megatron's three type names.

``SentencePieceTokenizer`` is megapipe's: eod is the model's ``</s>``, pad its pad id, and the
BERT roles are found by their usual piece spellings. Megatron-LM's ``GPTSentencePieceTokenizer``
and ``Llama2Tokenizer`` have eod = eos and pad from the model but no BERT roles, and
``Llama2Tokenizer`` starts every ``tokenize`` with the model's ``<s>`` (bos), so data
preprocessed with it in either framework has the same ids.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import sentencepiece

from megapipe.data.tokenizer.base import Tokenizer
from megapipe.errors import ConfigError

MODEL_FILE = "tokenizer.model"  # the name Llama's Hugging Face directories give it
# Piece spellings looked up for the BERT roles; eod and pad come from the model's own ids.
BERT_PIECES = {"cls": ("[CLS]", "<cls>"), "sep": ("[SEP]", "<sep>"), "mask": ("[MASK]", "<mask>")}


class SentencePieceTokenizer(Tokenizer):
    """Wraps ``sentencepiece.SentencePieceProcessor``; eod is the model's eos id (``</s>``)."""

    bert_pieces = BERT_PIECES  # role -> spellings looked up in the model
    prepends_bos = False

    def __init__(self, tokenizer_model: str):
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.Load(tokenizer_model)
        except (OSError, RuntimeError) as error:
            raise ConfigError(f"--tokenizer-model {tokenizer_model} is not a SentencePiece model ({error}); "
                              "pass a .model file written by sentencepiece or tools/train_tokenizer.py.") from None
        self._processor = processor
        self._model_file = tokenizer_model
        special_ids = {"eod": self._own_id(processor.eos_id()), "pad": self._own_id(processor.pad_id())}
        for role, pieces in self.bert_pieces.items():
            special_ids[role] = self._find_piece(pieces)
        self._bos = [processor.bos_id()] if self.prepends_bos else []
        if self._bos == [-1]:
            raise ConfigError(f"--tokenizer-model {tokenizer_model} has no <s> (bos) piece, which "
                              f"{type(self).__name__} starts every text with; use --tokenizer-type "
                              "GPTSentencePieceTokenizer.")
        super().__init__(type(self).__name__, (type(self), (tokenizer_model,)), special_ids)

    @staticmethod
    def _own_id(token_id: int) -> Optional[int]:
        return token_id if token_id >= 0 else None

    def _find_piece(self, pieces: Sequence[str]) -> Optional[int]:
        for piece in pieces:
            token_id = self._processor.piece_to_id(piece)
            if self._processor.id_to_piece(token_id) == piece:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    def tokenize(self, text: str) -> list[int]:
        return self._bos + self._processor.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])

    def save(self, directory: str) -> dict[str, str]:
        with open(os.path.join(directory, MODEL_FILE), "wb") as f:
            f.write(self._processor.serialized_model_proto())
        return {"tokenizer_type": self.name, "tokenizer_model": MODEL_FILE}

    def hf_backend(self):
        """transformers' conversion of the model's own settings (normalizer, dummy prefix, byte fallback,
        merges from the piece scores), which encodes as ``SentencePieceProcessor.encode``."""
        from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

        extractor = SentencePieceExtractor(self._model_file)
        return SpmConverter.build_tokenizer_from_spm_proto(extractor.proto, extractor.extract(None)["vocab"])


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron-LM's ``GPTSentencePieceTokenizer``: eod = eos, pad from the model, no BERT roles."""

    bert_pieces: dict = {}


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's ``Llama2Tokenizer``: as ``GPTSentencePieceTokenizer``, with bos before every text."""

    prepends_bos = True
