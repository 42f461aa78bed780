"""Step time with and without optimizer post-validation, iteration after iteration, on the executor.

    python benchmarks/bench_post_validation.py                      # p = 2 and 4, m = 8, 5 rounds
    python benchmarks/bench_post_validation.py --pipeline-sizes 4 --rounds 9

For each pipeline size one world of p processes (gloo) trains the same small GPT with
megapipe's ``PipelineEngine`` twice per schedule, with the synchronous step and with
``--enable-optimizer-post-validation``, from the same weights on the same data: ZB-H2 with
untied embeddings, ZB-H2 with tied ones (the first and last stage then sum the embedding's
gradient at every step, a dependency post-validation keeps), ZBV with tied ones (the V
placement holds both copies on rank 0, so no stage waits for that sum), and the schedule searched
(``--pipeline-schedule auto``) for equal stage costs within ZB-H2's memory (2p - 1
microbatches per rank; within 1F1B's, p, the search finds a schedule whose first rank ends
last, which post-validation cannot speed up, as ``tests/test_iterations.py`` shows for 1F1B).

EMULATED STAGE COSTS (an artificial delay, not model compute), as in
``bench_schedule_search.py``: before every F, BI and BW each rank sleeps ``--pass-ms``
milliseconds (a whole B twice that), so on a 2-core machine the p sleeping processes behave
like p dedicated devices; the small model's real compute, gradients, messages and steps still run.

A measurement is ``--iterations`` steps back to back (no barrier between them: the point is
that a post-validated iteration may start before the other stages have stepped), then
``drain`` (the last step validated), between two barriers. The variants take turns, the order
rotating every round; reported are the median seconds per step, the median of the per-round
ratios post-validated / synchronous with their quartiles, the simulator's ratio for the same
costs and the same steps back to back (``schedules/analysis/iterations.py``, without and with a
barrier at each step: (N 3m + p - 1) / N (3m + p - 1) for N steps of ZB-H2, which tends to
3m / (3m + p - 1)), and whether the losses and final weights of both runs are equal bit for bit.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench_schedule_search import EmulatedCosts, EmulatedSettings
from harness import cli, report
from harness.models import same_weights, step_microbatches
from harness.pairing import take_turns
from harness.ratios import paired, quartiles
from megapipe.models import build_model_chunks
from megapipe.optim import OptimizerConfig
from megapipe.parallel.state import ParallelState
from megapipe.schedules.analysis.iterations import replay_iterations
from megapipe.schedules.analysis.schedule_search import search_schedule
from megapipe.schedules.analysis.simulate import CostModel
from megapipe.schedules.catalog import build_schedule
from megapipe.pipeline.engine import PipelineEngine
from megapipe.layout.placement import Placement
from megapipe.testing.worlds import run_distributed


@dataclass(frozen=True)
class PostValidationSettings(EmulatedSettings):
    num_microbatches: int = 8
    pass_ms: float = 20.0
    slow_rank: int = -1  # no slow rank: equal stage costs
    rounds: int = 5
    iterations: int = 6  # steps back to back per measurement
    tied: bool = False  # each variant says


def variants(p: int, m: int) -> dict:
    """Name -> (schedule, tied embeddings, chunks per rank), the searched schedule found for equal unit costs."""
    unit = CostModel.per_rank(p, 1, [1], [1], [1])
    searched = search_schedule(p, m, unit, memory_limit=2 * p - 1, v=1).schedule
    return {"zb-h2": ("zb-h2", False, 1), "zb-h2, tied embeddings": ("zb-h2", True, 1), "auto": (searched, False, 1),
            "zbv, tied embeddings": ("zbv", True, 2)}


class Run:
    """One variant's engine on this rank, synchronous or post-validated, over its own weights."""

    def __init__(self, settings: PostValidationSettings, ps: ParallelState, chunks, schedule, post_validation: bool,
                 v: int):
        config = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0,
                                 enable_optimizer_post_validation=post_validation)
        self.chunks = chunks
        self.engine = PipelineEngine(chunks, ps, config, schedule, settings.num_microbatches,
                                     settings.activation_shape)
        EmulatedCosts(settings, ps.pp_rank, v).install(self.engine)
        self.losses: list[torch.Tensor] = []

    def measure(self, settings: PostValidationSettings, first_step: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for step in range(first_step, first_step + settings.iterations):
            self.losses += self.engine.train_batch(step_microbatches(settings, step)).batch.loss_tensors
        self.engine.drain()
        dist.barrier()
        return (time.perf_counter() - start) / settings.iterations


def world(rank: int, p: int, settings: PostValidationSettings) -> dict:
    states = {1: ParallelState.initialize(pipeline=p),
              2: ParallelState.initialize(pipeline=p, virtual_pipeline=2, placement=Placement.V)}
    runs = {}
    for name, (schedule, tied, v) in variants(p, settings.num_microbatches).items():
        ps = states[v]
        config = settings.model_config(tied)
        first = build_model_chunks("gpt", config, ps)
        for post_validation in (False, True):
            runs[(name, post_validation)] = Run(settings, ps, same_weights(config, ps, first), schedule,
                                                post_validation, v)
    for run in runs.values():  # a warm-up measurement each
        run.measure(settings, 0)
    keys = list(runs)
    times = take_turns(keys, settings.rounds, lambda key, r: runs[key].measure(settings, settings.iterations * (1 + r)))
    equal = {}
    for name in {key[0] for key in keys}:
        sync, post = runs[(name, False)], runs[(name, True)]
        same_losses = all(torch.equal(a, b) for a, b in zip(sync.losses, post.losses))
        same_params = all(torch.equal(a, b) for x, y in zip(sync.chunks, post.chunks)
                          for a, b in zip(x.parameters(), y.parameters()))
        equal[name] = (same_losses and same_params, post.engine.validation.rollbacks)
    return {"times": times, "equal": equal}


def predicted_ratio(schedule, p: int, v: int, settings: PostValidationSettings) -> float:
    """The simulator's post-validated / synchronous time of one measurement (its steps back to back)."""
    schedule = build_schedule(schedule, p, settings.num_microbatches, v) if isinstance(schedule, str) else schedule
    unit = CostModel.per_rank(p, v, [1], [1], [1])
    free, synchronized = (replay_iterations(schedule, unit, settings.iterations, synchronized).makespan
                          for synchronized in (False, True))
    return float(free / synchronized)


def main(argv=None) -> int:
    parser = cli.parser(__doc__, rounds=PostValidationSettings.rounds)
    parser.add_argument("--pipeline-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, default=PostValidationSettings.num_microbatches)
    parser.add_argument("--pass-ms", type=float, default=PostValidationSettings.pass_ms)
    parser.add_argument("--iterations", type=int, default=PostValidationSettings.iterations)
    args = parser.parse_args(argv)
    settings = PostValidationSettings(num_microbatches=args.microbatches, pass_ms=args.pass_ms, rounds=args.rounds,
                                      iterations=args.iterations)
    print(f"m={settings.num_microbatches}; emulated stage costs (artificial delay): {settings.pass_ms:g} ms per F, BI "
          f"and BW of every stage; GPT {settings.num_layers} layers h={settings.hidden_size}, AdamW, --clip-grad 1; "
          f"{settings.rounds} rounds of {settings.iterations} steps back to back; {report.machine()}")
    report.print_markdown(["p", "schedule", "synchronous s/step", "post-validated s/step",
                           "post / sync: median of rounds (quartiles)", "simulator post / sync",
                           "losses and weights equal (rollbacks)"], [])
    failed = False
    for p in args.pipeline_sizes:
        results = run_distributed(p, world, settings, timeout=3600, collective_timeout=600)
        times, schedules = results[0]["times"], variants(p, settings.num_microbatches)
        for name, (schedule, tied, v) in schedules.items():
            sync, post = times[(name, False)], times[(name, True)]
            low, median, high = quartiles(paired(post, sync))
            # the replay does not model the first and last stage's embedding sum (none under the V placement)
            predicted = "-" if tied and v == 1 else f"{predicted_ratio(schedule, p, v, settings):.3f}"
            equal = all(result["equal"][name][0] for result in results)
            rollbacks = max(result["equal"][name][1] for result in results)
            failed |= not equal
            print(report.markdown_row([p, name, f"{statistics.median(sync):.3f}", f"{statistics.median(post):.3f}",
                                       f"{median:.3f} ({low:.2f}-{high:.2f})", predicted,
                                       f"{'yes' if equal else 'NO'} ({rollbacks})"]), flush=True)
    print(f"\nload average at the end: {report.load_average()}; with tied embeddings on the looped placement "
          "the first stage would wait p - 1 passes per step for the last stage's embedding gradient, which the "
          "iteration replay reports but does not model (tests/test_iterations.py)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
