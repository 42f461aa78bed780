"""What the benchmarks share: settings and flags, model and data, turns and timing, ratios, reports.

Each benchmark is one script (``python benchmarks/bench_*.py``) that pairs megapipe with an
alternative (DDP, FSDP2, ``torch.distributed.pipelining``, Hugging Face, Gavel's figures) and
prints a Markdown table; the pieces every pairing needs live here once:

* ``cli``: the argument parser described by the script's docstring, and the common flags;
* ``settings``: the GPT and run sizes of the distributed benchmarks, and their model config;
* ``models``: same-weight copies of a model, batches, the stage wrapper and loss PyTorch's
  schedules need, megapipe's engine step and its AdamW for the other side;
* ``pairing``: a step between barriers (wall and CPU time), systems taking turns in rotated order;
* ``ratios``: paired ratios, their median and quartiles, geometric means, rank correlation;
* ``report``: Markdown and fixed-width tables, the machine line, JSON and Markdown result files.

Importing the package puts the checkout on ``sys.path``, so the scripts run without installing.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
