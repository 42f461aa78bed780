"""Draw a pipeline schedule as the papers do: one row per rank, forward and backward boxes.

Examples::

    python tools/plot_schedule.py --schedule 1f1b -p 4 -m 8 -o 1f1b.png
    python tools/plot_schedule.py --schedule interleaved -p 4 -m 8 -v 2 --chrome-trace trace.json
    python tools/plot_schedule.py --schedule-file my_schedule.txt --latency 0.1
    python tools/plot_schedule.py --timeline run.json            # a timeline recorded by the executor
    python tools/plot_schedule.py --search -p 4 -m 8 -v 2 --forward-time 1,3/2,1,1 \
        --input-backward-time 1,3/2,1,1 --weight-backward-time 1,3/2,1,1 --schedule-memory-limit 4 \
        --save-schedule auto.txt      # a schedule for these costs, next to the named ones

Simulated costs are per pipeline rank (one value for all, or one per rank: forward 1, backward
2 by default, a split backward's BI and BW half of it each) and split evenly over the v chunks
of a rank; a summary (makespan, bubble, peak activations, messages) is printed. ``--search``
runs the schedule search (``schedule_search.py``) for those costs and prints its predicted
batch time, bubble and peak activations next to every named schedule's.
"""

import argparse
import os
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megapipe.errors import ConfigError, reports_user_errors  # noqa: E402
from megapipe.layout.placement import Placement  # noqa: E402
from megapipe.schedules.analysis.schedule_search import comparison, search_schedule  # noqa: E402
from megapipe.schedules.schedule_file import load_schedule, save_schedule  # noqa: E402
from megapipe.schedules.catalog import build_schedule, schedule_names  # noqa: E402
from megapipe.schedules.analysis.simulate import CostModel, simulate  # noqa: E402
from megapipe.schedules.analysis.timeline import Timeline  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--schedule", choices=schedule_names(), help="a built-in schedule to simulate")
    source.add_argument("--schedule-file", help="a schedule written as text or CSV (see schedule_file.py)")
    source.add_argument("--timeline", help="a timeline JSON saved from a real run (Timeline.save)")
    source.add_argument("--search", action="store_true",
                        help="search a schedule for the costs below within --schedule-memory-limit")
    parser.add_argument("-p", "--pipeline-model-parallel-size", type=int, default=4, dest="p")
    parser.add_argument("-m", "--num-microbatches", type=int, default=8, dest="m")
    parser.add_argument("-v", "--virtual-pipeline-model-parallel-size", type=int, default=1, dest="v")
    costs = parser.add_argument_group("simulated costs per pipeline rank: one value for all or one per rank, "
                                      "comma-separated (numbers or fractions such as 1/3)")
    costs.add_argument("--forward-time", type=_times, default=[Fraction(1)], help="forward of one whole stage")
    costs.add_argument("--backward-time", type=_times, default=[Fraction(2)], help="backward of one whole stage")
    costs.add_argument("--input-backward-time", type=_times, help="BI of one whole stage (default: half the backward)")
    costs.add_argument("--weight-backward-time", type=_times, help="BW of one whole stage (default: half the backward)")
    costs.add_argument("--latency", type=Fraction, default=Fraction(0), help="time of one message")
    parser.add_argument("--schedule-memory-limit", type=Fraction,
                        help="--search: most microbatches' activations a rank may hold (default p, 1F1B's peak)")
    parser.add_argument("--save-schedule", help="also write the schedule as text, for --schedule-file")
    parser.add_argument("-o", "--output", help="PNG to write (default: named after the schedule)")
    parser.add_argument("--chrome-trace", help="also write a Chrome/Perfetto trace JSON here")
    parser.add_argument("--save-timeline", help="also save the simulated timeline JSON here")
    return parser.parse_args(argv)


def _times(text: str) -> list[Fraction]:
    return [Fraction(part) for part in text.split(",")]


def cost_model(args: argparse.Namespace, p: int, v: int, placement: Placement = Placement.LOOPED) -> CostModel:
    halves = [b / 2 for b in args.backward_time]
    return CostModel.per_rank(p, v, args.forward_time, args.input_backward_time or halves,
                              args.weight_backward_time or halves, latency=args.latency, placement=placement)


def search(args: argparse.Namespace):
    """Search, print the comparison with the named schedules, and return the found schedule's simulation."""
    costs = cost_model(args, args.p, args.v)
    limit = args.p if args.schedule_memory_limit is None else args.schedule_memory_limit
    found = search_schedule(args.p, args.m, costs, limit, args.v)
    print("\n".join(comparison(found, lambda v: cost_model(args, args.p, v), limit)))
    return found.simulation


@reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from megapipe.schedules.analysis.plot import draw_simulation, draw_timeline

        if args.timeline:
            timeline = Timeline.load(args.timeline)
            output = args.output or os.path.splitext(args.timeline)[0] + ".png"
            draw_timeline(timeline, output)
        else:
            if args.search:
                result = search(args)
                schedule = result.schedule
            else:
                schedule = (load_schedule(args.schedule_file) if args.schedule_file
                            else build_schedule(args.schedule, args.p, args.m, args.v))
                costs = cost_model(args, schedule.p, schedule.v, schedule.placement)
                result = simulate(schedule.compute_only(), costs)  # receives placed for these costs
            timeline = result.timeline
            output = args.output or f"{schedule.name}-p{schedule.p}-m{schedule.m}-v{schedule.v}.png"
            draw_simulation(result, output)
            print(f"{schedule.name}: p={schedule.p} m={schedule.m} v={schedule.v}  makespan {result.makespan} "
                  f"({float(result.makespan):g})  bubble {result.bubble_fraction} ({float(result.bubble_fraction):.2%})")
            print("peak activations per rank (stages):", ", ".join(str(a) for a in result.peak_activations))
            print("messages sent per rank:", ", ".join(str(n) for n in result.messages_sent))
            if args.save_timeline:
                timeline.save(args.save_timeline)
            if args.save_schedule:
                save_schedule(schedule, args.save_schedule)
                print(f"wrote {args.save_schedule}")
    except OSError as error:  # a path the user gave
        raise ConfigError(f"{error}; check the file and folder names given.") from None
    print(f"wrote {output}")
    if args.chrome_trace:
        timeline.to_chrome_trace(args.chrome_trace)
        print(f"wrote {args.chrome_trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
