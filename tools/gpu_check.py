"""GPU acceptance in one command (``bash tools/gpu_check.sh``); the steps and the runner live in
``megapipe.acceptance``. On a machine without a CUDA device it says so and exits 0."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megapipe.acceptance.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
