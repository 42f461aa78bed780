"""Tokenizers behind one interface (``Tokenizer``), chosen by Megatron's ``--tokenizer-type`` names."""

from megapipe.data.tokenizer.base import Tokenizer
from megapipe.data.tokenizer.build import TOKENIZER_TYPES, build_tokenizer

__all__ = ["Tokenizer", "TOKENIZER_TYPES", "build_tokenizer"]
