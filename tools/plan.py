"""Choose a parallel layout: rank (t, p, d, micro-batch, schedule, recomputation) by predicted throughput.

Examples::

    # a measured profile (tools/profile_model.py) on a cluster described in JSON
    python tools/plan.py --profile gpt.profile.json --cluster cluster.json --global-batch-size 64

    # a GPT too big to profile here, from FLOP counts, on a preset cluster
    python tools/plan.py --model gpt-3.8b --cluster v100-16gb-8x8 --global-batch-size 512 \\
        --plan-out plan.json --plot-out plan.png

    # PipeDream's partitioner: uneven stages with their own replication, weight stashing
    python tools/plan.py --model gpt-1.3b --cluster v100-16gb-1x8 --pipedream --micro-batch-size 4

Prints the best configurations, the torchrun command of the best, and writes the plan file
(``--plan-out``) the training scripts accept and a throughput map over (d, p) (``--plot-out``). A best
plan on an asynchronous schedule (2BW, PipeDream) comes with a note that it trains with stale
weights and with the best synchronous plan beside it.
Cluster presets: v100-16gb-1x8, v100-16gb-8x8, a100-80gb-1x8, a100-80gb-8x8.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megapipe.errors import ConfigError, reports_user_errors  # noqa: E402
from megapipe.config import ModelConfig  # noqa: E402
from megapipe.config.moe import check_layer_freq, layer_freq  # noqa: E402
from megapipe.config.sharding import SHARDING_STRATEGIES  # noqa: E402
from megapipe.planner.analytic import analytic_gpt_profile  # noqa: E402
from megapipe.planner.cluster import Cluster  # noqa: E402
from megapipe.planner.cost_model import Training  # noqa: E402
from megapipe.planner.context_costs import PLANNED_COMM_TYPES  # noqa: E402
from megapipe.planner.launch import pipedream_plan, torchrun_command, uniform_plan, write_plan  # noqa: E402
from megapipe.planner.profile_partition import partition_profile  # noqa: E402
from megapipe.planner.plan import PlanRequest, plan  # noqa: E402
from megapipe.planner.presets import CLUSTERS, MODELS, cluster_preset, model_preset  # noqa: E402
from megapipe.planner.profile import ModelProfile, ModelShape  # noqa: E402
from megapipe.planner.schedule_costs import FLUSHING, SCHEDULES, flushes  # noqa: E402
from megapipe.planner.units import human_bytes  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_argument_group("model (a profile, a preset, or a shape with --achieved-flops)")
    source.add_argument("--profile", help="JSON written by tools/profile_model.py")
    source.add_argument("--model", help=f"preset shape: {', '.join(MODELS)}")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size",
                 "--ffn-hidden-size"):
        source.add_argument(flag, type=int, help="model shape (checked against --profile when both are given)")
    for flag, help in (("--num-experts", "MoE shape: routed experts per block (the planner then searches e)"),
                       ("--moe-router-topk", "MoE shape: experts per token (default 2)"),
                       ("--moe-ffn-hidden-size", "MoE shape: each expert's hidden size (default --ffn-hidden-size)")):
        source.add_argument(flag, type=int, help=help)
    source.add_argument("--moe-layer-freq", type=layer_freq, default=1,
                        help="MoE shape: every N-th block holds experts, or one 0/1 per block, e.g. 1,0,1,0 (default 1)")
    source.add_argument("--model-type", choices=("gpt", "bert"), default="gpt")
    source.add_argument("--achieved-flops", type=float,
                        help="FLOP/s one device reaches on large GEMMs, for a closed-form profile "
                             "(default: the cluster's achieved_flops)")
    source.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                        help="closed-form profile: weight and activation type")
    source.add_argument("--explicit-attention", action="store_true",
                        help="closed-form profile: count the [s, s] attention scores explicit attention keeps (the "
                             "paper's count; runs with --no-masked-softmax-fusion), not a fused kernel's log-sum-exp")
    run = parser.add_argument_group("cluster and batch")
    run.add_argument("--cluster", required=True, help=f"JSON file or preset: {', '.join(CLUSTERS)}")
    run.add_argument("--global-batch-size", type=int, help="samples per optimizer step (required unless --pipedream)")
    search = parser.add_argument_group("search")
    search.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset of the schedules")
    search.add_argument("--max-micro-batch-size", type=int, default=64)
    search.add_argument("--context-parallel-sizes", default="1", help=(
        "comma-separated --context-parallel-size values to search (each sequence over c ranks); default 1"))
    search.add_argument("--cp-comm-type", default="p2p", choices=PLANNED_COMM_TYPES,
                        help="how the context ranks of the searched layouts exchange keys and values")
    search.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    search.add_argument("--data-parallel-sharding-strategies", default=",".join(SHARDING_STRATEGIES),
                        help="comma-separated --data-parallel-sharding-strategy levels to consider when d > 1")
    search.add_argument("--overlap-grad-reduce", action="store_true",
                        help="plan with data-parallel reductions overlapped (the command then turns overlap on)")
    search.add_argument("--pipedream", action="store_true",
                        help="run PipeDream's partitioner (uneven stages, replication, weight stashing) instead")
    search.add_argument("--micro-batch-size", type=int, help="--pipedream: the micro-batch size to partition for")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="rows in the table")
    out.add_argument("--plan-out", help="write the best plan as JSON")
    out.add_argument("--plot-out", help="write a PNG of predicted throughput over (d, p)")
    return parser.parse_args(argv)


def load_cluster(name: str) -> Cluster:
    return Cluster.load(name) if name.endswith(".json") or Path(name).exists() else cluster_preset(name)


def shape_from_flags(args) -> ModelShape | None:
    given = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                           "vocab_size", "ffn_hidden_size")}
    if args.moe_layer_freq != 1 and not args.num_experts:
        raise ConfigError("--moe-layer-freq says which blocks hold experts; add --num-experts, or drop it for a "
                          "dense model.")
    if all(v is None for v in given.values()):
        if args.num_experts:
            raise ConfigError("--num-experts describes a shape given by flags; add --num-layers, --hidden-size, "
                              "--num-attention-heads, --seq-length and --vocab-size.")
        return None
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
               if given[k] is None]
    if missing:
        raise ConfigError(f"a model shape needs --{missing[0].replace('_', '-')} as well; give the whole shape or use "
                          "--model or --profile.")
    experts, topk = args.num_experts, args.moe_router_topk or 2
    moe = dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
               moe_layer_freq=args.moe_layer_freq, add_bias_linear=False) if experts else {}
    if experts and topk > experts:
        raise ConfigError(f"--moe-router-topk {topk} exceeds --num-experts {experts}; route to at most as many "
                          "experts as there are.")
    if experts:
        check_layer_freq(args.moe_layer_freq, given["num_layers"])
    return ModelShape.from_config(args.model_type, ModelConfig(**given, **moe))


def load_profile(args, cluster: Cluster) -> ModelProfile:
    shape = shape_from_flags(args)
    if args.profile:
        preset = model_preset(args.model) if args.model else None
        return ModelProfile.load(args.profile, expected=shape or preset)
    shape = shape or (model_preset(args.model) if args.model else None)
    if shape is None:
        raise ConfigError("no model given; pass --profile, --model or a shape (--num-layers, --hidden-size, ...).")
    flops = args.achieved_flops or cluster.achieved_flops
    if not flops:
        raise ConfigError("a closed-form profile needs --achieved-flops (or achieved_flops in the cluster "
                          "description); or measure one with tools/profile_model.py and pass --profile.")
    return analytic_gpt_profile(shape, flops, dtype=args.dtype, flash=not args.explicit_attention)


def format_table(result, top: int, moe: bool = False, context: bool = False) -> str:
    """The best layouts; the last five columns (six for an MoE model, ``moe``: its experts' token exchange
    as well, with e, ``&`` where pairs hide the exchange (``--overlap-moe-expert-parallel-comm``), the
    expert-tensor size etp, and the share of the exchange that no pair hides; six with ``context``: the
    key/value exchange, and c) are seconds per batch on the slowest rank."""
    expert = f" {'e':>4} {'etp':>3}" if moe else ""
    cp = f" {'c':>3}" if context else ""
    header = (f"{'#':>3} {'t':>3}{cp} {'p':>3} {'d':>3}{expert} {'v':>2} {'b':>4} {'m':>5} {'schedule':<12} "
              f"{'recompute':<9} {'dp sharding':<18} "
              f"{'samples/s':>10} {'TFLOP/s/dev':>11} {'memory/dev':>10} {'bubble':>7} {'compute':>8} {'tp comm':>8} "
              + (f"{'cp comm':>8} " if context else "")
              + (f"{'ep comm':>8} {'exposed':>7} " if moe else "") + f"{'pp comm':>8} {'dp comm':>8} {'optim':>8}")
    rows = [header, "-" * len(header)]
    for rank, e in enumerate(result.ranked[:top], 1):
        candidate = e.candidate
        recompute = f"k={e.recompute_layers}" if candidate.recompute else "no"
        expert = f" {str(candidate.expert) + ('&' if candidate.overlap_moe_comm else ''):>4} {candidate.etp:>3}" if moe else ""
        cp = f" {candidate.context:>3}" if context else ""
        rows.append(f"{rank:>3} {candidate.tensor:>3}{cp} {candidate.pipeline:>3} {candidate.data:>3}{expert} {candidate.virtual:>2} "
                    f"{candidate.micro_batch_size:>4} {e.microbatches:>5} {candidate.schedule:<12} {recompute:<9} "
                    f"{candidate.sharding:<18} "
                    f"{e.samples_per_second:>10.4g} {e.flops_per_gpu / 1e12:>11.3g} {human_bytes(e.memory):>10} "
                    f"{e.bubble:>7.3f} {e.compute_time:>8.3g} {e.tensor_comm_time:>8.3g} "
                    + (f"{e.context_comm_time:>8.3g} " if context else "")
                    + (f"{e.expert_comm_total:>8.3g} {_share(e.expert_comm_time, e.expert_comm_total):>7} " if moe else "")
                    + f"{e.pipeline_comm_time:>8.3g} {e.data_comm_time:>8.3g} {e.optimizer_time:>8.3g}")
    return "\n".join(rows)


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def expert_comm_line(estimate) -> str:
    """The best layout's expert all-to-alls: their time on the slowest rank and how much of it stays exposed."""
    total, exposed = estimate.expert_comm_total, estimate.expert_comm_time
    hidden = "; pairs hide the rest behind the other microbatch's compute" if estimate.candidate.overlap_moe_comm else ""
    return (f"expert all-to-alls: {total:.4g} s per batch on the slowest rank, {exposed:.4g} s of it exposed "
            f"({_share(exposed, total)}{hidden})")


def run_pipedream(args, profile: ModelProfile, cluster: Cluster) -> None:
    if not args.micro_batch_size:
        raise ConfigError("--pipedream partitions for one micro-batch size; pass --micro-batch-size.")
    training = Training(args.micro_batch_size)
    result = partition_profile(profile, cluster, args.micro_batch_size, training)
    document = pipedream_plan(result, profile.shape, cluster, args.micro_batch_size)
    print(f"PipeDream partition of {profile.shape.num_layers} blocks over {result.workers} devices "
          f"({cluster.name or 'cluster'}): config {result.config_name}, NOAM {result.noam}, "
          f"{result.time_per_input * 1e3:.3g} ms per microbatch "
          f"({document['predicted']['samples_per_second']:.4g} samples/s)")
    for stage in result.stages:
        print(f"  layers {stage.start:>3}-{stage.end - 1:<3} x{stage.replicas:<3} in flight {stage.in_flight}")
    print(f"\n{document['command']}")
    if args.plan_out:
        write_plan(document, args.plan_out)
        print(f"plan written to {args.plan_out}")


def _shardings(names: str) -> tuple[str, ...]:
    chosen = tuple(name for name in names.split(",") if name)
    unknown = [name for name in chosen if name not in SHARDING_STRATEGIES]
    if unknown or not chosen:
        raise ConfigError(f"--data-parallel-sharding-strategies {names} names {', '.join(unknown) or 'no level'}; "
                          f"use a comma-separated subset of {', '.join(SHARDING_STRATEGIES)}.")
    return chosen


def _context_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(word) for word in text.split(",") if word)
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--context-parallel-sizes {text} must list positive integers separated by commas, "
                          "e.g. 1,2,4.")
    return sizes


def stale_weights_note(result) -> str:
    """For an asynchronous best plan: that it trains with stale weights, and the best synchronous plan beside it."""
    best = result.best
    note = (f"note: {best.candidate.schedule} is asynchronous: 2BW and PipeDream never flush the pipeline, so "
            "gradients are computed on weights one or more updates old (stale weights), which can change "
            "convergence compared with a synchronous schedule")
    synchronous = next((e for e in result.ranked if flushes(e.candidate.schedule)), None)
    if synchronous is None:
        return f"{note}; no synchronous layout was searched (add one of {', '.join(FLUSHING)} to --schedules)."
    slower = 1 - synchronous.samples_per_second / best.samples_per_second
    return (f"{note}.\nbest synchronous: {synchronous.candidate.describe()}: {synchronous.samples_per_second:.4g} "
            f"samples/s ({slower:.1%} slower), {human_bytes(synchronous.memory)} per device "
            f"(--schedules {','.join(FLUSHING)} plans only synchronous schedules)")


def run_planner(args, profile: ModelProfile, cluster: Cluster) -> None:
    if not args.global_batch_size:
        raise ConfigError("--global-batch-size is required; it is the batch every layout must reach.")
    request = PlanRequest(args.global_batch_size, schedules=tuple(s for s in args.schedules.split(",") if s),
                          max_micro_batch_size=args.max_micro_batch_size,
                          recompute=(False,) if args.no_recompute else (False, True),
                          shardings=_shardings(args.data_parallel_sharding_strategies),
                          training=Training(args.global_batch_size, overlap=args.overlap_grad_reduce),
                          context_sizes=_context_sizes(args.context_parallel_sizes), cp_comm_type=args.cp_comm_type)
    result = plan(profile, cluster, request)
    shape = profile.shape
    print(f"{shape.kind} with {shape.num_layers} layers, h={shape.hidden_size}, s={shape.seq_length} "
          f"({profile.source} profile) on {cluster.num_gpus} devices ({cluster.name or 'cluster'}, "
          f"{human_bytes(cluster.usable_memory)} usable each), global batch {args.global_batch_size}: "
          f"{len(result.ranked)} of {result.evaluated} layouts fit")
    print(format_table(result, args.top, profile.shape.is_moe, request.context_sizes != (1,)))
    best = result.best
    print(f"\nbest: {best.candidate.describe()}: {best.samples_per_second:.4g} samples/s, "
          f"{human_bytes(best.memory)} per device")
    if best.expert_comm_total:
        print(expert_comm_line(best))
    if not flushes(best.candidate.schedule):
        print(stale_weights_note(result))
    print(torchrun_command(best, shape, cluster, args.global_batch_size, args.overlap_grad_reduce))
    if args.plan_out:
        write_plan(uniform_plan(best, shape, cluster, args.global_batch_size, args.overlap_grad_reduce),
                   args.plan_out)
        print(f"plan written to {args.plan_out}")
    if args.plot_out:
        from megapipe.planner.plot import plot_throughput

        plot_throughput(result, args.plot_out, f"{shape.kind} l={shape.num_layers} h={shape.hidden_size} on "
                                               f"{cluster.num_gpus} devices, batch {args.global_batch_size}")
        print(f"plot written to {args.plot_out}")


@reports_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    cluster = load_cluster(args.cluster)
    profile = load_profile(args, cluster)
    (run_pipedream if args.pipedream else run_planner)(args, profile, cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
