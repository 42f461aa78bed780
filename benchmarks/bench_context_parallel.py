"""Context-parallel attention on CPU (gloo): one causal attention layer's forward + backward at c = 1, 2, 4
for every comm type, its time and memory per rank, the ring's overlap, and PyTorch's context_parallel.

    python benchmarks/bench_context_parallel.py                 # seq 4096, c = 1, 2, 4, 4 timed steps each
    python benchmarks/bench_context_parallel.py --quick         # seq 256, c = 1, 2, 1 timed step: a smoke test
    python benchmarks/bench_context_parallel.py --seq-length 16384 --json cp.json --trace cp_ring.json
    python benchmarks/bench_context_parallel.py --gpt 2        # a whole GPT training step of 2 layers

One world of max(c) gloo processes (one thread each) runs every configuration in turn, all ranks
busy in each: at c = 1 every rank attends over the whole sequence on its own, at c = 2 the ranks
pair up, and so on, so the machine carries the same load whatever c is and the ratio of c = 1's
step time to c's shows what splitting the sequence gains (c at best). Every rank holds the same
whole-sequence q, k, v and output gradient; a rank of a context group takes its chunks (i and
2c-1-i). Before timing, each configuration's outputs and q, k, v gradients are checked against
``megapipe.fusions.attention`` over the whole sequence (the rank's rows of it) within 1e-5. Then the
configurations take turns, one step each per round between barriers, in an order rotated every
round; the table gives the median step and the median over rounds of c = 1's step time over this
configuration's (``context_attention`` at c = 1 is the base; ``fusions.attention`` is PyTorch's SDPA
without the log-sum-exp path).

Memory per rank, two measures (CPU has no allocator statistics): the bytes autograd saves for the
backward (``saved_tensors_hooks``, each storage once), and the rise of the process's peak resident
set over the step (``/proc/self/clear_refs`` resets the peak; tensors of 64 KiB and more are put in
their own mappings, so memory freed during the step leaves the resident set). The first is exact and
covers what a model keeps per layer; the second includes what lives only during the step (blocks in
flight, gathered keys and values, fp32 accumulators, the gradients).

The ring (p2p at the largest c) runs one more step with a ``Timeline``: per ring step, when the
transfer was posted and waited and when the block computed, and the fraction of the transfer's time
(posted to waited) during which that block's compute ran; ``--trace`` writes every rank's timeline as
a Chrome trace (chrome://tracing, Perfetto).

``--gpt LAYERS``: a whole GPT training step instead (megapipe's engine at p = 1, AdamW, gradients
reduced over the d x c ranks, each configuration its own copy of the same weights and the same
sequence, cut to each rank's chunks as the data loader does); the first step's loss is checked
against c = 1's (whose attention is ``fusions.attention``, the base of the ratios), and weights are
left out of the saved bytes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import statistics
import sys

import torch
from harness import cli, report
from harness.models import adamw, batch, microbatches, same_weights
from harness.pairing import take_turns, timed
from harness.ratios import median_ratio
from harness.settings import Settings

from megapipe.context_parallel import Timeline, context_attention
from megapipe.data.context_batch import context_share
from megapipe.errors import ConfigError, first_line, reports_user_errors
from megapipe.fusions.attention import attention
from megapipe.layout.context import check_sequence_split, local_positions
from megapipe.layout.context_comm import COMM_TYPES
from megapipe.models import build_model_chunks
from megapipe.parallel.context import ContextGroups
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.engine import PipelineEngine
from megapipe.testing.worlds import run_distributed

TOLERANCE = 1e-5
BASE = (1, "context_attention")
SDPA = (1, "fusions.attention")
TORCH = "torch context_parallel"
MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class CPSettings:
    seq_length: int = 4096
    batch: int = 1
    heads: int = 4
    query_groups: int = 4
    head_dim: int = 64
    context_sizes: tuple[int, ...] = (1, 2, 4)
    rounds: int = 4
    gpt_layers: int = 0  # --gpt: a whole GPT step of this many layers instead of one attention layer

    @property
    def world(self) -> int:
        return max(self.context_sizes)

    def describe(self) -> str:
        if self.gpt_layers:
            return (f"GPT training step (forward, backward, AdamW), {self.gpt_layers} layers, hidden "
                    f"{self.heads * self.head_dim}, {self.heads} heads, vocab {self.gpt().vocab_size}, batch 1, seq "
                    f"{self.seq_length}, fp32; {self.world} gloo processes, gradients reduced over all of them "
                    f"(d x c); {self.rounds} timed steps per configuration after a checked and a measured one")
        return (f"causal attention, batch {self.batch}, seq {self.seq_length}, {self.heads} heads, "
                f"{self.query_groups} query groups, head dim {self.head_dim}, fp32; {self.world} gloo processes; "
                f"{self.rounds} timed steps per configuration after a checked and a measured one")

    def configurations(self) -> list[tuple[int, str]]:
        """(c, comm type) of every configuration: at c = 1 the plain SDPA and context_attention's one
        block; above, each comm type the heads allow (a2a+p2p as all-to-alls in pairs and a ring of c/2)."""
        result = [SDPA] if self.gpt_layers else [SDPA, BASE]  # a GPT at c = 1 attends with fusions.attention
        for c in sorted(set(self.context_sizes) - {1}):
            for comm in COMM_TYPES:
                a2a = {"a2a": c, "a2a+p2p": 2}.get(comm, 1)
                if comm == "a2a+p2p" and (c < 4 or c % 2):
                    continue
                if self.heads % a2a == 0 and self.query_groups % a2a == 0:
                    result.append((c, comm))
        return result

    def check(self) -> None:
        """One sentence per bad flag combination, before any process starts."""
        if min(self.context_sizes) < 1 or any(self.world % c for c in self.context_sizes):
            raise ConfigError(f"--context-sizes {' '.join(map(str, self.context_sizes))}: every size must be at "
                              "least 1 and divide the largest (the number of processes); choose sizes such as 1 2 4.")
        if self.heads % self.query_groups:
            raise ConfigError(f"--heads {self.heads} is not a multiple of --query-groups {self.query_groups}; "
                              "choose query groups that divide the heads.")
        if self.gpt_layers and self.query_groups != self.heads:
            raise ConfigError("--gpt runs megapipe's GPT, whose heads are all key/value heads; drop --query-groups.")
        check_sequence_split(self.seq_length, self.world)

    def gpt(self) -> Settings:
        """--gpt's model and run: one microbatch of one sequence, no dropout, untied embeddings."""
        return Settings(num_layers=self.gpt_layers, hidden_size=self.heads * self.head_dim,
                        num_attention_heads=self.heads, seq_length=self.seq_length, micro_batch_size=1,
                        num_microbatches=1)


def name_of(configuration: tuple[int, str]) -> str:
    return f"c={configuration[0]} {configuration[1]}"


# ---- groups ---------------------------------------------------------------------------------------------

def parallel_state(world: int, c: int, comm: str) -> ParallelState:
    """world / c replicas of c context ranks each, as a run's layout makes them (a2a+p2p: all-to-alls
    in pairs, a ring of c / 2 across them). Collective: every rank calls it."""
    return ParallelState.initialize(data=world // c, context=c, cp_comm_type=comm,
                                    hierarchical_context=(2, c // 2) if comm == "a2a+p2p" else None)


# ---- memory ---------------------------------------------------------------------------------------------

def own_mappings_for_large_tensors() -> None:
    """glibc: allocations of 64 KiB and more get their own mapping, returned when freed (the default
    threshold grows after frees and would keep freed tensors resident, hiding the step's peak)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_rss_rise(step) -> int | None:
    """Bytes by which the peak resident set rose above its level before ``step()`` (None where the
    peak cannot be reset)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
        before = _status_kib("VmRSS")
    except OSError:
        return None
    step()
    return (_status_kib("VmHWM") - before) * 1024


def saved_bytes(step, weights: frozenset = frozenset()) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``step()`` runs its forward,
    but for those at the addresses ``weights`` (parameters, which a step keeps whatever c is)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


# ---- steps ----------------------------------------------------------------------------------------------

def whole_inputs(settings: CPSettings) -> list[torch.Tensor]:
    """q, k, v and the output gradient [b, heads or groups, s, d] of the whole sequence, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    shape = lambda n: (settings.batch, n, settings.seq_length, settings.head_dim)
    return [torch.randn(shape(n), generator=g) for n in (settings.heads, settings.query_groups,
                                                          settings.query_groups, settings.heads)]


def step_of(attend, inputs, timeline: Timeline | None = None):
    """One forward + backward of ``attend(q, k, v)`` on fresh leaves: (output, dq, dk, dv)."""
    q, k, v, grad = inputs

    def step():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, timeline=timeline)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]
    return step


def attends_of(world: int, settings: CPSettings, whole) -> dict:
    """Every configuration on this rank: (attend(q, k, v, timeline=None), its inputs, the rows of the
    whole sequence it computes)."""
    scale = settings.head_dim ** -0.5
    sdpa = lambda q, k, v, timeline=None: attention(q, k, v, causal=True, scale=scale)
    result = {SDPA: (sdpa, whole, slice(None))}
    made = {}  # one layout per c serves p2p, all_gather and a2a
    for c, comm in settings.configurations()[1:]:
        shared = comm if comm == "a2a+p2p" else "p2p"
        if c > 1 and (c, shared) not in made:
            made[c, shared] = parallel_state(world, c, shared).context_groups
        groups = ContextGroups.single() if c == 1 else dataclasses.replace(made[c, shared], comm_type=comm)
        rows = torch.tensor(local_positions(settings.seq_length, c, groups.index))
        attend = functools.partial(context_attention, groups=groups, seq_length=settings.seq_length, causal=True,
                                   scale=scale)
        result[c, comm] = (attend, [t[:, :, rows].contiguous() for t in whole], rows)
    return result


def relative_diff(got: list[torch.Tensor], want: list[torch.Tensor], rows) -> float:
    """The largest difference from ``want`` (its ``rows`` of the sequence; all of it for None), relative
    to ``want``'s largest magnitude."""
    return max(float((a - (b if rows is None else b[:, :, rows])).abs().max() / b.abs().max())
               for a, b in zip(got, want))


def gpt_steps(world: int, settings: CPSettings) -> tuple[dict, frozenset]:
    """--gpt: every configuration's training step on this rank, each its own copy of one GPT (same
    weights) with megapipe's engine (p = 1, AdamW), the loss compared whole; and its weights' addresses."""
    model = settings.gpt()
    config = model.model_config()
    reference = build_model_chunks("gpt", config, ParallelState.single())
    tokens, labels = batch(model, 0)
    microbatch = microbatches(tokens, labels, 1)[0]
    steps, weights = {}, set()
    for c, comm in settings.configurations():
        ps = parallel_state(world, c, "p2p" if c == 1 else comm)
        chunks = same_weights(config, ps, reference)
        weights.update(p.untyped_storage().data_ptr() for chunk in chunks for p in chunk.parameters())
        engine = PipelineEngine(chunks, ps, adamw(), "1f1b", 1, (model.seq_length // c, 1, model.hidden_size))
        mine = context_share(microbatch, model.seq_length, ps)
        steps[c, comm] = (lambda engine=engine, mine=mine: [torch.tensor(engine.train_batch([mine]).losses)], None)
    return steps, frozenset(weights)


def torch_context_parallel(world: int, settings: CPSettings, whole):
    """PyTorch's ``context_parallel`` over all ranks, SDPA inside it: (step, its first step's result)
    where it runs, else (None, the reason caught)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh("cpu", (world,))
        scale = settings.head_dim ** -0.5

        def step():
            buffers = [t.clone() for t in whole]  # sharded in place inside the context
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4):
                leaves = [t.detach().requires_grad_() for t in buffers[:3]]
                out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale,
                                                                       enable_gqa=settings.heads != settings.query_groups)
                out.backward(buffers[3])
                return [out.detach()] + [t.grad for t in leaves]
        return step, step()
    except Exception as error:  # noqa: BLE001 - whatever stops it on this machine is the finding
        return None, first_line(error)


# ---- the ring's timeline ----------------------------------------------------------------------------------

def hidden(transfer, compute) -> float:
    """The fraction of ``transfer``'s time (posted to waited) during which ``compute`` ran."""
    both = min(transfer.end, compute.end) - max(transfer.start, compute.start)
    return max(both, 0.0) / (transfer.end - transfer.start)


def ring_steps(events) -> list[tuple]:
    """(phase, step, transfer event or None, compute event or None) in time order of the ring steps."""
    keyed = {(e.phase, e.step, e.kind): e for e in events}
    keys = sorted({(e.phase, e.step) for e in events}, key=lambda key: (key[0] != "forward", key[1]))
    return [(phase, step, keyed.get((phase, step, "transfer")), keyed.get((phase, step, "compute")))
            for phase, step in keys]


def hidden_total(events, phase: str) -> float:
    """Of all of ``phase``'s transfer time, the fraction during which the same step's compute ran."""
    pairs = [(t, c) for p, _, t, c in ring_steps(events) if p == phase and t is not None]
    total = sum(t.end - t.start for t, _ in pairs)
    return sum(hidden(t, c) * (t.end - t.start) for t, c in pairs if c is not None) / total


def print_timeline(rank: int, events) -> None:
    origin = min(e.start for e in events)
    interval = lambda e: "-" if e is None else f"{(e.start - origin) * 1e3:8.1f} .. {(e.end - origin) * 1e3:8.1f}"
    print(f"\nring (p2p) timeline of rank {rank}, ms from its first event:")
    print_rows = [[phase, step, interval(t), interval(c), "-" if t is None or c is None else f"{hidden(t, c):.0%}"]
                  for phase, step, t, c in ring_steps(events)]
    report.print_markdown(["phase", "ring step", "transfer posted .. waited", "block compute", "transfer hidden"],
                          print_rows)


def chrome_trace(timelines: list[list]) -> dict:
    """Every rank's timeline as Chrome trace events: one process per rank, a row for computes and one
    for transfers."""
    origin = min(e.start for events in timelines for e in events)
    return {"displayTimeUnit": "ms", "traceEvents": [
        {"name": f"{e.phase} step {e.step} {e.kind}", "cat": e.kind, "ph": "X", "pid": rank, "tid": e.kind,
         "ts": (e.start - origin) * 1e6, "dur": (e.end - e.start) * 1e6}
        for rank, events in enumerate(timelines) for e in events]}


# ---- one world ------------------------------------------------------------------------------------------

def world_run(rank: int, world: int, settings: CPSettings) -> dict:
    torch.set_num_threads(1)
    own_mappings_for_large_tensors()
    barriers, torch_reason, attends, weights = world > 1, None, {}, frozenset()
    if settings.gpt_layers:
        steps, weights = gpt_steps(world, settings)
        reference = SDPA
    else:
        whole = whole_inputs(settings)
        attends = attends_of(world, settings, whole)
        steps = {key: (step_of(attend, inputs), rows) for key, (attend, inputs, rows) in attends.items()}
        reference = SDPA
    results = {reference: steps[reference][0]()}  # the first step of every configuration is the check
    if barriers and not settings.gpt_layers:
        torch_step, outcome = torch_context_parallel(world, settings, whole)
        if torch_step is None:
            torch_reason = outcome
        else:
            steps[world, TORCH] = (torch_step, torch.tensor(local_positions(settings.seq_length, world, rank)))
            results[world, TORCH] = outcome
    diff, saved, rss = {}, {}, {}
    for key, (step, rows) in steps.items():
        result = results[key] if key in results else timed(step, barriers)[2]
        diff[key] = relative_diff(result, results[reference], rows)
        saved[key] = saved_bytes(step, weights)
        rss[key] = timed(functools.partial(peak_rss_rise, step), barriers)[2]
    wall = take_turns(list(steps), settings.rounds, lambda key, r: timed(steps[key][0], barriers)[0])
    timeline = Timeline()
    if (world, "p2p") in attends:
        attend, inputs, _ = attends[world, "p2p"]
        timed(step_of(attend, inputs, timeline))
    return {"wall": wall, "diff": diff, "saved": saved, "rss": rss, "events": timeline.events, "torch": torch_reason}


# ---- the report -----------------------------------------------------------------------------------------

def rows_of(per_rank: list[dict]) -> list[dict]:
    """One row per configuration: median step, paired ratio to c = 1, memory per rank (the largest over
    ranks) and its ratio to c = 1's, the largest difference from the reference over ranks."""
    wall = per_rank[0]["wall"]
    base = BASE if BASE in wall else SDPA
    peak = lambda measure, key: None if any(r[measure][key] is None for r in per_rank) else max(
        r[measure][key] for r in per_rank)
    rows = []
    for key in wall:
        saved, rss = peak("saved", key), peak("rss", key)
        base_rss = peak("rss", base)
        rows.append({"c": key[0], "attention": key[1], "step_s": statistics.median(wall[key]),
                     "speedup": median_ratio(wall[base], wall[key]), "saved_bytes": saved,
                     "saved_ratio": saved / peak("saved", base), "rss_bytes": rss,
                     "rss_ratio": None if rss is None or not base_rss else rss / base_rss,
                     "diff": max(r["diff"][key] for r in per_rank)})
    return rows


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / MIB:,.1f}"


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_rows(rows: list[dict]) -> None:
    report.print_markdown(
        ["c", "attention", "step (ms, median)", "c=1 time / this time", "saved for backward per rank (MiB)",
         "vs c=1", "peak RSS rise per rank (MiB)", "vs c=1", "max rel. diff"],
        ([r["c"], r["attention"], f"{r['step_s'] * 1e3:,.0f}", f"**{r['speedup']:.2f}**", _mib(r["saved_bytes"]),
          _ratio(r["saved_ratio"]), _mib(r["rss_bytes"]), _ratio(r["rss_ratio"]), f"{r['diff']:.1e}"]
         for r in sorted(rows, key=lambda r: (r["c"], r["attention"] == SDPA[1]))))


def print_overlap(per_rank: list[dict]) -> dict:
    """Rank 0's ring steps, and every rank's fraction of transfer time hidden per phase."""
    if not per_rank[0]["events"]:
        return {}
    print_timeline(0, per_rank[0]["events"])
    fractions = {phase: [hidden_total(r["events"], phase) for r in per_rank] for phase in ("forward", "backward")}
    for phase, values in fractions.items():
        print(f"{phase}: transfer time hidden behind compute per rank: "
              + ", ".join(f"{value:.0%}" for value in values))
    return fractions


@reports_user_errors
def main(argv=None) -> int:
    parser = cli.parser(__doc__, quick="seq 256, c = 1 and 2, one timed step: a smoke test", rounds_help="",
                        json="the settings, rows and overlap as JSON")
    parser.add_argument("--context-sizes", type=int, nargs="+", help="values of c (default 1 2 4; --quick: 1 2)")
    parser.add_argument("--seq-length", type=int, help="default 4096 (--quick: 256)")
    parser.add_argument("--heads", type=int, default=CPSettings.heads)
    parser.add_argument("--query-groups", type=int, help="key/value heads (default: as many as --heads)")
    parser.add_argument("--head-dim", type=int, default=CPSettings.head_dim)
    parser.add_argument("--gpt", type=int, metavar="LAYERS", default=0,
                        help="a whole GPT training step of LAYERS layers (hidden heads x head dim) instead of one "
                             "attention layer")
    parser.add_argument("--trace", metavar="PATH", help="the ring's timelines as a Chrome trace (JSON)")
    args = parser.parse_args(argv)
    settings = CPSettings(seq_length=args.seq_length or (256 if args.quick else CPSettings.seq_length),
                          heads=args.heads, query_groups=args.query_groups or args.heads, head_dim=args.head_dim,
                          context_sizes=tuple(args.context_sizes or ((1, 2) if args.quick else CPSettings.context_sizes)),
                          rounds=cli.rounds_of(args, CPSettings.rounds, quick=1), gpt_layers=args.gpt)
    settings.check()
    print(f"run: {settings.describe()}")
    print(f"machine: {report.machine()}, torch {torch.__version__}, one thread per rank")
    per_rank = (run_distributed(settings.world, world_run, settings, timeout=3600, collective_timeout=600)
                if settings.world > 1 else [world_run(0, 1, settings)])
    rows = rows_of(per_rank)
    print_rows(rows)
    overlap = print_overlap(per_rank)
    if per_rank[0]["torch"] is not None:
        print(f"\n{TORCH} does not run here (CPU, gloo): {per_rank[0]['torch']}")
    print(f"\nload average at the end: {report.load_average()}")
    report.write_json(args.json, {"settings": dataclasses.asdict(settings), "rows": rows, "hidden": overlap,
                                  "torch_context_parallel": per_rank[0]["torch"]})
    if args.trace and per_rank[0]["events"]:
        report.write_json(args.trace, chrome_trace([r["events"] for r in per_rank]))
    bad = [name_of((r["c"], r["attention"])) for r in rows if r["diff"] > TOLERANCE]
    if bad:
        print(f"FAILED: results differ from the reference by more than {TOLERANCE} in {', '.join(bad)}")
        return 1
    what = ("first-step losses agree with c = 1's" if settings.gpt_layers else
            "outputs and q, k, v gradients agree with fusions.attention")
    print(f"{what} within {TOLERANCE} on every rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
