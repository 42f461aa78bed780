"""The benchmarks' command lines: one parser per script, described by its docstring, and the flags
several share (``--quick``, ``--rounds``, ``--json``)."""

from __future__ import annotations

import argparse
from typing import Optional


def parser(doc: str, *, quick: Optional[str] = None, rounds: Optional[int] = None, rounds_help: Optional[str] = None,
           json: Optional[str] = None) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first paragraph, with ``--quick`` (help ``quick``),
    ``--rounds`` (default ``rounds``; ``None`` when ``--quick`` decides) and ``--json PATH`` (help
    ``json``) where given."""
    result = argparse.ArgumentParser(description=" ".join(doc.strip().split("\n\n")[0].split()))
    if quick is not None:
        result.add_argument("--quick", action="store_true", help=quick)
    if rounds is not None or rounds_help is not None:
        result.add_argument("--rounds", type=int, default=rounds, help=rounds_help or None)
    if json is not None:
        result.add_argument("--json", metavar="PATH", help=json or None)
    return result


def rounds_of(args: argparse.Namespace, default: int, quick: int = 2) -> int:
    """``--rounds`` when given, else ``quick`` rounds under ``--quick``, else ``default``."""
    return args.rounds or (quick if args.quick else default)
