"""One acceptance step in a process of its own: ``python -m megapipe.acceptance.step MODULE --record FILE``.

The runner gives each step its own process so a crash, a hang or a device left in a bad state
ends with that step. The process exits 0 once the step's function returns (its checks say whether
it passed) and 1 when the function itself raised, which is recorded as a failed check.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback

import torch

from megapipe.acceptance.record import Context, Record
from megapipe.errors import first_line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", help="the step: a module whose run(record, context) is called (module:function "
                                       "for another function)")
    parser.add_argument("--record", required=True, help="JSON-lines file the checks are appended to")
    parser.add_argument("--work", required=True, help="scratch folder of the step")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, with small shapes")
    parser.add_argument("--benchmark-arg", action="append", default=[], help="an extra argument of the benchmark")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds before the runner stops the step")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    record = Record(args.record)
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    context = Context(device, args.work, args.dry_run, tuple(args.benchmark_arg), args.budget)
    try:
        module, _, function = args.module.partition(":")
        getattr(importlib.import_module(module), function or "run")(record, context)
    except Exception as error:  # noqa: BLE001 - reported as the step's failure, the next step still runs
        traceback.print_exc()
        record.add(f"{args.module} raised", "failed", first_line(error))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
