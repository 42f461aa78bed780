"""The planner on a real two-level network: 2 hosts x 2 ranks, a shaped link between the hosts at
several bandwidths, every layout of a small GPT predicted and trained (root, Linux).

    python benchmarks/bench_planner_network.py                       # about 15 minutes on 2 busy cores
    python benchmarks/bench_planner_network.py --rates-mbit 50 1000  # other link speeds

1. Profile the GPT once and calibrate this machine with 4 processes on one host, exactly as
   ``bench_planner_vs_measured.py`` does (a fitted gloo link for the ranks inside a host, each
   process's compute speed and the cores the 4 share). The GPT is small in weights and long in
   sequence (h=128, s=256), so that what data parallelism sends (its weights) and what the
   pipeline sends (its activations) are within a few times of each other.
2. For each rate, make the two hosts and measure the links with 4 ranks on them (``probe_links``):
   one flow between the hosts and two at once (on this machine the kernel's packet work shares the
   2 busy cores, so a fast shaped link delivers below its rate, and two flows get more than one),
   a pair's all-reduce across the hosts, the 2-member all-reduces inside the hosts (the tensor and
   data groups a layout keeps there; a collective's step costs more than a message on busy cores),
   and a pair's exchange in both directions, which shows that on one gloo connection a receive
   posted just after a send waits for that send's tensor before its own moves (the planner's
   ``exposed_transfers``). Then describe the machine as the planner's two-level cluster: 2 nodes
   of 2 devices, the calibrated processes, each device sending one flow at the one-flow bandwidth
   and a node's flows sharing an uplink of what two flows got (``Cluster.node_uplink_bandwidth``),
   with the fitted all-reduce costs. Plan over every layout (t, p, d) of 4 devices at micro-batch
   2 under 1F1B, and run PipeDream's hierarchical partitioner.
3. Make two test hosts (network namespaces) joined by ``tc`` links of that rate and train every
   layout for real, 2 ranks per host (``bench_planner_vs_measured.train_layouts``: all engines
   built and warmed up, then every round times one step of each layout between barriers;
   median over rounds).
4. Print predicted and measured samples/s side by side, their Spearman rank correlation, the
   planner's first choice against the measured best, and the partitioner's choice (one stage
   replicated 4 times, i.e. data parallelism, or stages split between the hosts) next to which
   of data parallelism (1, 1, 4) and the 2-stage pipeline across hosts (1, 2, 2) measured faster.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from harness import cli
from harness.pairing import timed as between_barriers
from harness.ratios import spearman
from harness.report import print_markdown
import bench_planner_vs_measured
from bench_planner_vs_measured import (GLOBAL_BATCH, describe_machine, machine_speed, probe_time, profile_once,
                                       train_layouts)
from megapipe.config import ModelConfig
from megapipe.planner.cluster import Cluster
from megapipe.planner.cost_model import PlanCostModel, Candidate, Training
from megapipe.planner.profile_partition import partition_profile
from megapipe.planner.plan import PlanRequest, plan
from megapipe.planner.units import human_bytes
from megapipe.testing.worlds import run_distributed
from megapipe.testing.hosts import TestHosts

HOSTS, PER_HOST = 2, 2
MICRO_BATCH = 2
MODEL = dict(bench_planner_vs_measured.MODEL, hidden_size=128, num_attention_heads=4, seq_length=256, vocab_size=1024)
bench_planner_vs_measured.MODEL = MODEL  # its calibration probes this model's block
LINK_SIZES = [2 ** k for k in range(14, 23, 2)]  # 16 KiB to 4 MiB
LAYOUTS = [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]  # every (t, p, d) of 4 devices


def probe_links(rank, world_size, sizes, repeats):
    """Seconds per size (ranks 0, 1 on host 0 and 2, 3 on host 1; every probe between barriers, so its
    time is the slowest rank's): a one-way message between one rank on each host (half a ping-pong),
    messages from both ranks of host 0 to those of host 1 at once (two flows leaving a host, one
    direction, so they cannot take turns with the other direction), a 2-member all-reduce between the
    hosts on one pair, and 2-member all-reduces inside both hosts at once (the tensor and data groups
    a layout keeps inside a host); then, for a tensor of the largest size, a pair's exchange in both
    directions with each receive posted before its send, and with one side posting its receive just
    after its send, as the lowered 1F1B lists do."""
    across, inside = [dist.new_group([0, 2]), dist.new_group([1, 3])], [dist.new_group([0, 1]), dist.new_group([2, 3])]
    peer = (rank + 2) % 4

    def timed(step) -> float:
        return between_barriers(lambda: [step() for _ in range(repeats)])[0] / repeats

    rows = {"one flow": [], "two flows": [], "all-reduce across": [], "all-reduce inside": []}
    for size in sizes:
        x = torch.zeros(size // 4)

        def ping_pong(active):
            if rank in active:
                if rank < 2:
                    dist.send(x, peer)
                    dist.recv(x, peer)
                else:
                    dist.recv(x, peer)
                    dist.send(x, peer)

        rows["one flow"].append(timed(lambda: ping_pong((0, 2))) / 2)
        rows["two flows"].append(timed(lambda: dist.send(x, peer) if rank < 2 else dist.recv(x, peer)))
        rows["all-reduce across"].append(timed(lambda: rank in (0, 2) and dist.all_reduce(x, group=across[0])))
        rows["all-reduce inside"].append(timed(lambda: dist.all_reduce(x, group=inside[rank // 2])))
    x, y = torch.zeros(sizes[-1] // 4), torch.zeros(sizes[-1] // 4)

    def exchange(receive_first: bool):
        if rank not in (0, 2):
            return
        if rank == 2:  # the other side's posts come first, as a neighbour's do in the steady state
            time.sleep(0.02)
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
        if receive_first:
            ops.reverse()
        works = dist.batch_isend_irecv(ops[:1])
        if rank == 2 and not receive_first:
            time.sleep(0.005)  # the send is under way when the receive is posted
        for work in works + dist.batch_isend_irecv(ops[1:]):
            work.wait()

    rows["exchange, receives first"] = [timed(lambda: exchange(True)) - 0.02]
    rows["exchange, a receive after a send"] = [timed(lambda: exchange(False)) - 0.025]
    return rows


def slope(sizes, times) -> float:
    """Bytes per second between the two largest sizes (a shaped link lets small messages through at full
    speed from its burst, so a fit over all sizes would overrate it)."""
    return (sizes[-1] - sizes[-2]) / (times[-1] - times[-2])


def latency(times, bandwidth: float, steps: int) -> float:
    """Seconds per step beyond the bytes' time: the median over the three smallest sizes (one alone is
    noisy on busy cores)."""
    return statistics.median(max(0.0, t - size / bandwidth) / steps for size, t in zip(LINK_SIZES[:3], times))


def fit_host_links(hosts) -> dict:
    """The links between and inside the hosts, as the planner's cluster describes them (``two_level``)."""
    rows = run_distributed(HOSTS * PER_HOST, probe_links, LINK_SIZES, 3, hosts=hosts)[0]
    for name, times in rows.items():
        sizes = LINK_SIZES if len(times) == len(LINK_SIZES) else LINK_SIZES[-1:]
        print(f"{name}: " + ", ".join(f"{human_bytes(s)} {1e3 * t:.1f} ms" for s, t in zip(sizes, times)))
    one = rows["one flow"]
    fit = dict(bandwidth=slope(LINK_SIZES, one), uplink=2 * slope(LINK_SIZES, rows["two flows"]),
               reduce_bandwidth=slope(LINK_SIZES, rows["all-reduce across"]),  # a 2-member ring moves its bytes
               inside_reduce_bandwidth=slope(LINK_SIZES, rows["all-reduce inside"]))  # over each link
    fit["latency"] = latency(one, fit["bandwidth"], 1)
    fit["reduce_latency"] = latency(rows["all-reduce across"], fit["reduce_bandwidth"], 2)  # 2 steps
    fit["inside_reduce_latency"] = latency(rows["all-reduce inside"], fit["inside_reduce_bandwidth"], 2)
    print(f"fitted between the hosts: {fit['latency'] * 1e3:.2f} ms per message, {fit['bandwidth'] / 1e6:.1f} MB/s "
          f"for one flow, {fit['uplink'] / 1e6:.1f} MB/s for two at once, {fit['reduce_bandwidth'] / 1e6:.1f} MB/s "
          f"and {fit['reduce_latency'] * 1e3:.2f} ms per step in a pair's all-reduce; inside a host "
          f"{fit['inside_reduce_bandwidth'] / 1e6:.0f} MB/s and {fit['inside_reduce_latency'] * 1e3:.2f} ms per step "
          f"in all-reduces; a pair's exchange of {human_bytes(LINK_SIZES[-1])} each way takes "
          f"{rows['exchange, receives first'][0] / one[-1]:.2f} one-way transfers with the receives posted first, "
          f"{rows['exchange, a receive after a send'][0] / one[-1]:.2f} with a receive posted after a send")
    return fit


def two_level(flat: Cluster, rate_mbit: float, fit: dict) -> Cluster:
    """The calibrated single-node machine as 2 nodes of 2, joined by the fitted links: a device sends one
    flow at the one-flow bandwidth, and a node's flows share its uplink (what two flows got together)."""
    return replace(flat, nodes=HOSTS, gpus_per_node=PER_HOST, inter_node_bandwidth=fit["bandwidth"],
                   node_uplink_bandwidth=max(fit["uplink"], fit["bandwidth"]), inter_node_latency=fit["latency"],
                   inter_node_reduce_bandwidth=fit["reduce_bandwidth"], inter_node_reduce_latency=fit["reduce_latency"],
                   intra_node_reduce_bandwidth=fit["inside_reduce_bandwidth"],
                   intra_node_reduce_latency=fit["inside_reduce_latency"], backend="gloo",
                   name=f"2 hosts x 2, {rate_mbit:g} Mbit/s between them")


def nominal_link(megabytes_per_second: float, flat: Cluster) -> dict:
    """A link of that speed for every flow and the uplink, with the calibrated machine's latencies."""
    speed = megabytes_per_second * 1e6
    return dict(bandwidth=speed, uplink=speed, reduce_bandwidth=speed, latency=flat.intra_node_latency,
                reduce_latency=flat.intra_node_latency, inside_reduce_bandwidth=flat.intra_node_reduce_bandwidth,
                inside_reduce_latency=flat.intra_node_latency)


def as_bench_layout(t: int, p: int, d: int) -> tuple:
    return (t, p, d, MICRO_BATCH, "1f1b", 1, False)


def partitioner_choice(profile, cluster: Cluster) -> str:
    partition = partition_profile(profile, cluster, MICRO_BATCH, Training(GLOBAL_BATCH), limit_memory=False)
    stages = ", ".join(f"blocks {s.start}-{s.end - 1} x{s.replicas}" for s in partition.stages)
    kind = "data parallel" if len(partition.stages) == 1 else "pipeline"
    return f"{partition.config_name} ({kind}: {stages})"


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--rates-mbit", type=float, nargs="+", default=[20, 100, 1000])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(1)
    profile = profile_once(ModelConfig(**MODEL), cores)
    flat = describe_machine(profile, cores)
    layouts = [as_bench_layout(*tpd) for tpd in LAYOUTS]
    request = PlanRequest(GLOBAL_BATCH, schedules=("1f1b",), micro_batch_sizes=(MICRO_BATCH,), recompute=(False,),
                          shardings=("no_shard",))
    print("PipeDream's partitioner on this profile, 2 nodes x 2, over node uplinks of (MB/s): " + ", ".join(
        f"{mb:g}: {partitioner_choice(profile, two_level(flat, 8 * mb, nominal_link(mb, flat)))}"
        for mb in (1, 3, 10, 30, 100, 300, 1000, 3000)))
    summary = []
    for rate in args.rates_mbit:
        with TestHosts(HOSTS, rate_mbit=rate) as hosts:
            print(f"\n== {rate:g} Mbit/s between the hosts")
            cluster = two_level(flat, rate, fit_host_links(hosts))
            model = PlanCostModel(profile, cluster, Training(GLOBAL_BATCH))
            estimates = [model.estimate(Candidate(t, p, d, MICRO_BATCH, "1f1b")) for t, p, d in LAYOUTS]
            predicted = [estimate.samples_per_second for estimate in estimates]
            print(f"the planner's cluster: {json.dumps(cluster.to_dict())}")
            best = plan(profile, cluster, request).best.candidate
            chosen = (best.tensor, best.pipeline, best.data)
            partitioner = partitioner_choice(profile, cluster)
            start = time.perf_counter()
            per_rank = run_distributed(HOSTS * PER_HOST, train_layouts, layouts, MODEL, args.warmup, args.rounds,
                                       hosts=hosts, timeout=3600, collective_timeout=600)
        steps = [rank[0] for rank in per_rank]
        measured = [GLOBAL_BATCH / statistics.median(max(step) for step in zip(*(rank[i] for rank in steps)))
                    for i in range(len(layouts))]
        rho = spearman(predicted, measured)
        speed, cores_worth = machine_speed(probe_time(profile), per_rank[0][1], per_rank[0][2])
        during = replace(cluster, compute_speed=speed, shared_cores=cores_worth)
        again = [PlanCostModel(profile, during, Training(GLOBAL_BATCH)).estimate(
            Candidate(t, p, d, MICRO_BATCH, "1f1b")).samples_per_second for t, p, d in LAYOUTS]
        print(f"during the rounds the block probe gave speed {speed:.2f} and {cores_worth:.2f} devices' worth of cores "
              f"(calibrated before: {cluster.compute_speed:.2f} and {cluster.shared_cores:.2f}); Spearman with the "
              f"machine as probed during the rounds: {spearman(again, measured):.2f}")
        print(f"trained {len(layouts)} layouts x {args.warmup} + {args.rounds} rounds in "
              f"{time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.1f}")
        print(f"{'t p d':<8} {'predicted':>10} {'during':>7} {'measured':>9} {'/predicted':>10}   (samples/s); "
              "predicted seconds per batch: compute, tensor-parallel, pipeline waits (slowest rank), data-parallel")
        for tpd, guess, later, real, e in sorted(zip(LAYOUTS, predicted, again, measured, estimates),
                                                 key=lambda row: -row[3]):
            mark = "  <- planner's choice" if tpd == chosen else ""
            print(f"{' '.join(map(str, tpd)):<8} {guess:>10.2f} {later:>7.2f} {real:>9.2f} {real / guess:>10.2f}   "
                  f"{e.compute_time:.3f}, {e.tensor_comm_time:.3f}, {e.pipeline_comm_time:.3f}, "
                  f"{e.data_comm_time:.3f}{mark}")
        chosen_measured = measured[LAYOUTS.index(chosen)]
        dp, pp = measured[LAYOUTS.index((1, 1, 4))], measured[LAYOUTS.index((1, 2, 2))]
        print(f"Spearman {rho:.2f}; the planner's choice {chosen} measures {chosen_measured / max(measured):.0%} of "
              f"the measured best; PipeDream's partitioner: {partitioner}; measured: data parallel {dp:.2f}, pipeline "
              f"across hosts {pp:.2f} samples/s")
        summary.append((rate, rho, chosen, chosen_measured / max(measured), partitioner, dp, pp))
    print_markdown(["link", "Spearman", "planner's choice", "its measured share of the best", "PipeDream's partitioner",
                    "measured samples/s: DP (1,1,4) vs PP across hosts (1,2,2)"],
                   [[f"{rate:g} Mbit/s", f"{rho:.2f}", str(chosen), f"{share:.0%}", str(partitioner),
                     f"{dp:.2f} vs {pp:.2f} ({'PP' if pp > dp else 'DP'} faster)"]
                    for rate, rho, chosen, share, partitioner, dp, pp in summary])

if __name__ == "__main__":
    main()
