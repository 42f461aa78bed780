"""Tokenize local text into indexed datasets (.bin/.idx) in Megatron-LM's format, as its tool of the same name.

Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \\
        --append-eod --workers 4
    # writes data/corpus_text_document.bin/.idx; train with --data-path data/corpus_text_document
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megapipe.data.indexed_dataset import DEFAULT_FORMAT, FORMATS  # noqa: E402
from megapipe.data.preprocess import preprocess  # noqa: E402
from megapipe.data.tokenizer.flags import add_tokenizer_arguments, tokenizer_from_args  # noqa: E402
from megapipe.errors import reports_user_errors  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    data = parser.add_argument_group("input and output")
    data.add_argument("--input", nargs="+", required=True,
                      help="local files: .jsonl/.json (JSON lines), .parquet, anything else is plain text")
    data.add_argument("--json-keys", nargs="+", default=["text"],
                      help="fields (JSONL) or columns (Parquet) to tokenize, one dataset each")
    data.add_argument("--document-per-file", action="store_true",
                      help="plain text: one document per file instead of one per non-blank line")
    data.add_argument("--output-prefix", required=True,
                      help="writes <prefix>_<key>_document (or _sentence) .bin and .idx")
    data.add_argument("--split-sentences", action="store_true",
                      help="one sequence per sentence (BERT data)")
    data.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    data.add_argument("--output-format", choices=sorted(FORMATS), default=DEFAULT_FORMAT,
                      help="the .idx layout: Megatron-LM's (default; Megatron-LM reads it) or megapipe's own")
    data.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    data.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_tokenizer_arguments(parser)
    return parser.parse_args(argv)


@reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = tokenizer_from_args(args)
    prefixes = preprocess(args.input, args.output_prefix, tokenizer, json_keys=args.json_keys,
                          split_sentences=args.split_sentences, append_eod=args.append_eod,
                          document_per_file=args.document_per_file, workers=args.workers,
                          progress=not args.no_progress, output_format=args.output_format)
    for key, prefix in prefixes.items():
        print(f"{key}: {prefix}.bin / {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
