"""A process that only loads and saves checkpoints, for the tests that kill it in the middle of a save.

``python tests/save_loop_gpt.py ROOT [--saves N] [--async-save]`` builds a small GPT (a world of one), loads
ROOT's latest checkpoint through the real loader if there is one, checks that every weight holds
the value this script gave it for that iteration (``pattern``), prints ``loaded N``, then saves
iterations N+1, N+2, ... (for ever, or N times and exits 0), each with its own weights, printing ``saving N`` before each
save starts and ``saved N`` once it is published. The test kills it at a random moment of a save
and starts it again: each incarnation is a check that the previous checkpoint still loads, and
that the killed save's leftovers do not break the next save.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megapipe.checkpointing.paths import read_latest  # noqa: E402
from megapipe.cli.parse import parse_run  # noqa: E402
from megapipe.training.trainer import Trainer  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data", "--vocab-size", "256",
         "--train-iters", "1000000", "--eval-iters", "1", "--fusion-backend", "eager"]


def pattern(iteration: int, index: int) -> float:
    """The value of every element of parameter ``index`` in the checkpoint of ``iteration``."""
    return iteration + index / 1000


def parameters(trainer: Trainer) -> list[torch.nn.Parameter]:
    return [p for chunk in trainer.chunks for p in chunk.parameters()]


def saved_part(trainer: Trainer, p: torch.Tensor) -> torch.Tensor:
    """What a checkpoint keeps of parameter ``p``: a vocabulary's padding rows are not saved."""
    model = trainer.config.model
    return p[:model.vocab_size] if p.shape[0] == model.padded_vocab_size(1) else p


def main(root: str, saves: int, flags: list[str]) -> None:
    plan = parse_run("gpt", MODEL + ["--save", root, "--load", root] + flags, world_size=1)
    trainer = Trainer(plan)
    if read_latest(root) is not None:
        trainer.checkpointer.load(root)
    start = trainer.state.iteration
    for index, p in enumerate(parameters(trainer)):
        if start and not torch.all(saved_part(trainer, p) == pattern(start, index)):
            raise SystemExit(f"checkpoint of iteration {start} loaded {p.flatten()[:3].tolist()} into parameter "
                             f"{index}, not {pattern(start, index)}")
    print(f"loaded {start}", flush=True)
    for iteration in range(start + 1, start + 1 + saves):
        with torch.no_grad():
            for index, p in enumerate(parameters(trainer)):
                p.fill_(pattern(iteration, index))
        trainer.state.iteration = iteration
        trainer.checkpointer.wait()  # the previous asynchronous save is published
        if iteration > start + 1:
            print(f"saved {iteration - 1}", flush=True)
        print(f"saving {iteration}", flush=True)
        trainer.save(root)
    trainer.checkpointer.wait()
    print(f"saved {iteration}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--saves", type=int, default=sys.maxsize)
    args, flags = parser.parse_known_args()
    main(args.root, args.saves, flags)
