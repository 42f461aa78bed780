"""pretrain_gpt.py with every checkpoint save made slow ON PURPOSE, for tests only.

Each ``Trainer.save`` first waits ``SLOW_SAVE_SECONDS`` (environment), standing in for a
checkpoint large enough, or storage slow enough, to take longer than the 30 s torchrun gives its
workers after forwarding a SIGTERM. The save itself is megapipe's, unchanged, after the wait.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megapipe.training.cli import main  # noqa: E402
from megapipe.training.trainer import Trainer  # noqa: E402

real_save = Trainer.save


def slow_save(self, directory: str, last: bool = False) -> None:
    seconds = float(os.environ["SLOW_SAVE_SECONDS"])
    print(f"[test-only slow save] waiting {seconds:g} s before saving iteration {self.state.iteration}", flush=True)
    time.sleep(seconds)
    real_save(self, directory, last)


if __name__ == "__main__":
    Trainer.save = slow_save
    main("gpt")
