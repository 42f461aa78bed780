"""Draw a pipeline schedule as the papers do: one row per rank, forward and backward boxes.

Examples::

    python tools/plot_schedule.py --schedule 1f1b -p 4 -m 8 -o 1f1b.png
    python tools/plot_schedule.py --schedule interleaved -p 4 -m 8 -v 2 --chrome-trace trace.json
    python tools/plot_schedule.py --schedule-file my_schedule.txt --latency 0.1
    python tools/plot_schedule.py --timeline run.json            # a timeline recorded by the executor

Simulated costs are per stage (forward 1, backward 2 by default) and split evenly over the v
chunks of a rank; a summary (makespan, bubble, peak activations, messages) is printed.
"""

import argparse
import os
import sys
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megapipe.errors import ConfigError, ScheduleError  # noqa: E402
from megapipe.pipeline.analysis.plot import draw_simulation, draw_timeline  # noqa: E402
from megapipe.pipeline.ir.schedule_file import load_schedule  # noqa: E402
from megapipe.pipeline.ir.schedules import build_schedule, schedule_names  # noqa: E402
from megapipe.pipeline.analysis.simulate import CostModel, simulate  # noqa: E402
from megapipe.pipeline.analysis.timeline import Timeline  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--schedule", choices=schedule_names(), help="a built-in schedule to simulate")
    source.add_argument("--schedule-file", help="a schedule written as text or CSV (see schedule_file.py)")
    source.add_argument("--timeline", help="a timeline JSON saved from a real run (Timeline.save)")
    parser.add_argument("-p", "--pipeline-model-parallel-size", type=int, default=4, dest="p")
    parser.add_argument("-m", "--num-microbatches", type=int, default=8, dest="m")
    parser.add_argument("-v", "--virtual-pipeline-model-parallel-size", type=int, default=1, dest="v")
    costs = parser.add_argument_group("simulated costs (numbers or fractions such as 1/3)")
    costs.add_argument("--forward-time", type=Fraction, default=Fraction(1), help="forward of one whole stage")
    costs.add_argument("--backward-time", type=Fraction, default=Fraction(2), help="backward of one whole stage")
    costs.add_argument("--latency", type=Fraction, default=Fraction(0), help="time of one message")
    parser.add_argument("-o", "--output", help="PNG to write (default: named after the schedule)")
    parser.add_argument("--chrome-trace", help="also write a Chrome/Perfetto trace JSON here")
    parser.add_argument("--save-timeline", help="also save the simulated timeline JSON here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.timeline:
            timeline = Timeline.load(args.timeline)
            output = args.output or os.path.splitext(args.timeline)[0] + ".png"
            draw_timeline(timeline, output)
        else:
            schedule = (load_schedule(args.schedule_file) if args.schedule_file
                        else build_schedule(args.schedule, args.p, args.m, args.v))
            costs = CostModel.per_chunk(schedule.v, args.forward_time, args.backward_time, latency=args.latency)
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
    except (ConfigError, ScheduleError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    if args.chrome_trace:
        timeline.to_chrome_trace(args.chrome_trace)
        print(f"wrote {args.chrome_trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
