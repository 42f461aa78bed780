"""Megatron's tokenizer flags, shared by the tools and the training entry points."""

from __future__ import annotations

import argparse

from megapipe.data.tokenizer.base import Tokenizer
from megapipe.data.tokenizer.build import TOKENIZER_TYPES, build_tokenizer


def add_tokenizer_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, required=required,
                       help="which tokenizer; ByteLevelTokenizer needs no files, NullTokenizer only --vocab-size")
    group.add_argument("--vocab-file", help="GPT-2 vocab.json / encoder.json, or BERT vocab.txt")
    group.add_argument("--merge-file", help="GPT-2 merges.txt / vocab.bpe")
    group.add_argument("--tokenizer-model", help="SentencePiece .model, or a tokenizer.json (or its folder)")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer: ids 0 to N-1, and N ends each document")


def tokenizer_from_args(args: argparse.Namespace) -> Tokenizer:
    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)
