"""Evaluate a megapipe checkpoint with lm-evaluation-harness, on one process or a (t, p) layout under torchrun.

    python tools/eval_harness.py --load ckpt/ --tasks megapipe_tiny_mc \\
        --include-path examples/eval_tasks --limit 8
    torchrun --nproc_per_node 4 tools/eval_harness.py --load ckpt/ --tasks megapipe_tiny_mc,megapipe_tiny_gen \\
        --include-path examples/eval_tasks --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --output-path results.json

Global rank 0 runs lm_eval and prints its results table; every rank computes each batch of its
requests. Nothing is downloaded: tasks and their data are read from local files (lm_eval's own
tasks need their data sets in the local Hugging Face cache). ``--output-path`` gets lm_eval's
results with every example's requests and answers, as JSON.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm_eval imports datasets
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch.distributed as dist  # noqa: E402

from megapipe.atomic_files import write_atomically  # noqa: E402
from megapipe.errors import ConfigError, reports_user_errors  # noqa: E402
from megapipe.inference.commands import broadcast, follow  # noqa: E402
from megapipe.inference.eval_harness import lm_class  # noqa: E402
from megapipe.inference.loading import layout_flags, load_for_inference  # noqa: E402
from megapipe.optional import require  # noqa: E402
from megapipe.training.failures import report_user_error  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    layout_flags(parser)
    parser.add_argument("--tasks", required=True, help="comma-separated lm_eval task or group names")
    parser.add_argument("--include-path", help="a folder of task YAML files, besides lm_eval's own tasks")
    parser.add_argument("--num-fewshot", type=int, default=None)
    parser.add_argument("--limit", type=float, default=None, help="examples per task (a count, or a fraction < 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests per forward pass")
    parser.add_argument("--output-path", help="a JSON file for the results and every example's answers")
    return parser.parse_args(argv)


def task_manager(names: list, include_path):
    """lm_eval's task index that knows every name (the repository's folder first: lm_eval's own 15k
    tasks take seconds to index); ConfigError naming an unknown task."""
    tasks = require("lm_eval.tasks", "evaluation", "lm-eval")
    if include_path is not None and not os.path.isdir(include_path):
        raise ConfigError(f"--include-path {include_path} is no folder; pass the folder of your task YAML files.")
    manager = tasks.TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or len(manager.match_tasks(names)) < len(names):
        manager = tasks.TaskManager(include_path=include_path)
    unknown = [name for name in names if not manager.match_tasks([name])]
    if unknown:
        where = f" nor in --include-path {include_path}" if include_path else ""
        raise ConfigError(f"--tasks {unknown[0]} is no lm_eval task{where}; list the names with "
                          "`lm-eval ls tasks`, or pass --include-path with the folder defining it.")
    return manager


def write_json(path: str, results: dict) -> None:
    """``results`` as JSON at ``path``, all or nothing."""
    utils = require("lm_eval.utils", "evaluation", "lm-eval")
    write_atomically(path, json.dumps(results, indent=1, default=utils.handle_non_serializable))


@reports_user_errors(report=report_user_error)  # once per job under torchrun, as training does
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be at least 1.")
    names = [name for name in args.tasks.split(",") if name]
    if not names:
        raise ConfigError("--tasks names no task; pass lm_eval task names separated by commas.")
    manager = task_manager(names, args.include_path)
    loaded = load_for_inference(args, reads_text="evaluation")
    if dist.get_rank() != 0:
        follow(loaded)
        dist.destroy_process_group()
        return 0
    evaluator = require("lm_eval.evaluator", "evaluation", "lm-eval")
    try:
        results = evaluator.simple_evaluate(model=lm_class()(loaded, args.batch_size), tasks=names,
                                            num_fewshot=args.num_fewshot, limit=args.limit, task_manager=manager,
                                            log_samples=args.output_path is not None)
    finally:
        broadcast(("stop",))
    print(require("lm_eval.utils", "evaluation", "lm-eval").make_table(results), flush=True)
    if args.output_path:
        write_json(args.output_path, results)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
