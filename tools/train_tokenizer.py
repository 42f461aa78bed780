"""Train a tokenizer on local text files and print the flags that load it.

Kinds: ``bpe`` (GPT-2 style byte-level BPE -> GPT2BPETokenizer or HuggingFaceTokenizer),
``sentencepiece`` (-> SentencePieceTokenizer), ``wordpiece`` (BERT -> BertWordPiece*).
Example::

    python tools/train_tokenizer.py --input corpus.txt --kind bpe --vocab-size 8192 --output-prefix tok/corpus
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megapipe.data.readers import output_keys, read_documents  # noqa: E402
from megapipe.data.tokenizer.training import train_bpe, train_sentencepiece, train_wordpiece  # noqa: E402
from megapipe.errors import ConfigError, reports_user_errors  # noqa: E402

FLAG_NAMES = {"tokenizer_type": "--tokenizer-type", "vocab_file": "--vocab-file", "merge_file": "--merge-file",
              "tokenizer_model": "--tokenizer-model"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="local .jsonl, .parquet or plain text files")
    parser.add_argument("--json-key", default="text", help="field (JSONL) or column (Parquet) holding the text")
    parser.add_argument("--kind", choices=("bpe", "sentencepiece", "wordpiece"), required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output-prefix", required=True, help="path prefix of the files written")
    parser.add_argument("--sentencepiece-model-type", choices=("unigram", "bpe"), default="unigram")
    parser.add_argument("--cased", action="store_true", help="wordpiece: keep case (BertWordPieceCase)")
    return parser.parse_args(argv)


@reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.vocab_size < 1:
        raise ConfigError(f"--vocab-size {args.vocab_size} must be positive.")
    keys = output_keys(args.input, [args.json_key])
    texts = (document[args.json_key] for document in read_documents(args.input, keys))
    if args.kind == "bpe":
        flags = train_bpe(texts, args.vocab_size, args.output_prefix)
    elif args.kind == "sentencepiece":
        flags = train_sentencepiece(texts, args.vocab_size, args.output_prefix, args.sentencepiece_model_type)
    else:
        flags = train_wordpiece(texts, args.vocab_size, args.output_prefix, lowercase=not args.cased)
    print(" ".join(f"{FLAG_NAMES[name]} {value}" for name, value in flags.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
