"""Steps for the acceptance runner's tests: one that passes, one that fails a check, one that raises,
one that kills its process, and one that records a check and then never returns."""

import os
import threading


def passes(record, context):
    record.check("two plus two", lambda: "four" if 2 + 2 == 4 else None)


def fails(record, context):
    record.check("a wrong sum", lambda: (_ for _ in ()).throw(AssertionError("2 + 2 gave 5")))
    record.add("a figure", "noted", "42 TFLOP/s")


def raises(record, context):
    raise RuntimeError("the device fell off the bus")


def dies(record, context):
    os._exit(3)


def hangs(record, context):
    record.check("the part before the hang", lambda: "done")
    threading.Event().wait()  # never set: only the runner's deadline ends this step
