"""Predicted step time and MFU of megapipe's GPT training step on a named GPU, from kernels counted on fake tensors.

The step is ``bench_single_device.py``'s megapipe system (bf16 weights, fp32 master weights and main
gradients, 8 micro-batches of forward and backward, clipping and AdamW; dropout 0.1) at its
GPT-1.3B and GPT-350M shapes, run on fake tensors with the kernels a GPU runs, every kernel's FLOPs
and bytes counted (``megapipe.testing.step_model``). Each kernel takes max(FLOPs / (peak x
efficiency), bytes / (bandwidth x efficiency)) plus a launch; the efficiencies were fitted to the
step measured on one H100 (GPT-1.3B 1321 ms, GPT-350M 1049 ms). Rows: the step as the code stands
("now"), then the same step with each item of issue 40 switched by its flags; a flag this megapipe
does not have makes its row "not available". Then the time per category of "now", and per
micro-batch the kernels, allocations and bytes of each row.

Another commit's step: ``PYTHONPATH=<its checkout> python benchmarks/bench_step_model.py``; the
megapipe counted and its ``bench_single_device.py`` are that checkout's, the model this one's.

    python benchmarks/bench_step_model.py --device h100          # about 5 minutes on a 2-core CPU
    python benchmarks/bench_step_model.py --device h200 --shape gpt-1.3b
    python benchmarks/bench_step_model.py --device b200 --device-peak-tflops 2250 --device-bandwidth 8
    python benchmarks/bench_step_model.py --calibrate            # refit to the H100 figures (at their commit)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: a checkout given there is the one counted

import megapipe  # noqa: E402

COUNTED_ROOT = Path(megapipe.__file__).resolve().parents[1]
sys.path.insert(0, str(COUNTED_ROOT / "benchmarks"))


def _step_model():
    """``megapipe.testing.step_model``: the counted megapipe's, or this checkout's where it has none."""
    for name in ("op_costs", "step_model"):
        module = f"megapipe.testing.{name}"
        if importlib.util.find_spec(module) is None:
            spec = importlib.util.spec_from_file_location(module, ROOT / "megapipe" / "testing" / f"{name}.py")
            sys.modules[module] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[module])
    return importlib.import_module("megapipe.testing.step_model")


step_model = _step_model()

from bench_single_device import SHAPES, Megapipe, make_batch  # noqa: E402
import torch  # noqa: E402
from harness import cli  # noqa: E402
from harness.report import print_ruled, write_json  # noqa: E402
from megapipe.cli.flags import FIELD_FLAGS, build_parser  # noqa: E402
from megapipe.errors import ConfigError, UserError  # noqa: E402
from megapipe.models.families import family_of  # noqa: E402
from megapipe.testing.fake_device import FAKE_DEVICE  # noqa: E402

MICRO_BATCHES, DROPOUT = 8, 0.1
# (row, flags): the step now, then each item of issue 40 switched
ROWS = (
    ("now", ()),
    ("gradient-accumulation fusion off", ("--no-gradient-accumulation-fusion",)),
    ("cross-entropy fusion off", ("--no-cross-entropy-loss-fusion",)),
    ("selective recomputation", ("--recompute-granularity", "selective")),
    ("regional torch.compile", ("--fusion-backend", "compile")),
    ("FP8 (hybrid, tensorwise)", ("--fp8-format", "hybrid")),
)
# bench_single_device.py on one H100 80GB HBM3 (torch 2.11, commit 2568abb; docs/gpu.md): per shape and
# variant, its flags, seconds per step and the MFU of the forward and backward passes alone
MEASURED_H100 = {
    "gpt-1.3b": {"now": ((), 1.321, 0.464),
                 "elementwise fusions off": (("--no-bias-gelu-fusion", "--no-bias-dropout-fusion"), 1.349, 0.454),
                 "selective recompute": (("--recompute-granularity", "selective"), 1.402, 0.437),
                 "full recompute": (("--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"), 1.674, 0.365)},
    "gpt-350m": {"now": ((), 1.049, 0.346),
                 "elementwise fusions off": (("--no-bias-gelu-fusion", "--no-bias-dropout-fusion"), 1.092, 0.333),
                 "selective recompute": (("--recompute-granularity", "selective"), 1.164, 0.312),
                 "full recompute": (("--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"), 1.314, 0.276)},
}


def row_settings(flags: tuple[str, ...]) -> tuple[dict | None, dict | None, str | None]:
    """The ``ModelConfig`` fields and the FP8 choice (``training`` fields) that ``flags`` set, or Nones and why
    the row is not predicted."""
    parser = build_parser("gpt")
    try:
        given, default = vars(parser.parse_args(list(flags))), vars(parser.parse_args([]))
    except ConfigError as error:
        return None, None, f"not available in this megapipe ({str(error).split(';')[0]})"
    model, fp8, elsewhere = {}, {}, []
    for dest, value in given.items():
        if value == default[dest]:
            continue
        where = FIELD_FLAGS[dest]
        value = (not value) if where.negate else value
        if where.section == "model":
            model[where.field] = value
        elif (where.section, where.field) in (("training", "fp8_format"), ("training", "fp8_recipe")):
            fp8[where.field] = value
        else:
            elsewhere.append(f"{where.section}.{where.field}")
    if elsewhere:
        return None, None, (f"not modelled: {' '.join(flags)} sets {', '.join(elsewhere)}, which the step on fake "
                            "tensors cannot take")
    if fp8:
        fp8 = {"fp8_format": given["fp8_format"], "fp8_recipe": given["fp8_recipe"]}
    return model, fp8, None


@contextlib.contextmanager
def fp8_products(fp8: dict):
    """FP8 on, as the trainer turns it on for a GPU with FP8 matrix units (``select_fp8`` without the
    check of the device, which the fake device would fail)."""
    if not fp8:
        yield
        return
    from megapipe.fusions import fp8_mode
    from megapipe.fusions.fp8 import Fp8Recipe

    previous = fp8_mode.activate(Fp8Recipe(fp8["fp8_format"], fp8["fp8_recipe"]))
    try:
        yield
    finally:
        fp8_mode.activate(previous)


def count(shape_name: str, model: dict, fp8: dict, micro_batches: int):
    """The kernels of the step of ``shape_name`` with ``model``'s fields and the ``fp8`` choice."""
    shape = SHAPES[shape_name]
    system = Megapipe("megapipe", shape, FAKE_DEVICE, DROPOUT, **model)
    with fp8_products(fp8):
        return step_model.count_step(system, lambda seed: make_batch(shape, FAKE_DEVICE, seed), micro_batches)


def model_flops(shape_name: str, micro_batches: int) -> float:
    system = Megapipe("megapipe", SHAPES[shape_name], FAKE_DEVICE, DROPOUT)
    config = system.config()
    return family_of("gpt", config).flops(config, micro_batches * SHAPES[shape_name].micro_batch, recompute=False)


def commit_of(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "no git"
    except (OSError, subprocess.SubprocessError):
        return "no git"


def calibrate(shapes: list[str], micro_batches: int) -> None:
    """Fit the efficiencies to the H100's steps and passes as the code stood ("now"), then print every
    measured figure next to its prediction: the variants were not fitted."""
    gpu = step_model.gpu_part("h100")
    figures = []  # (shape, variant, what, counted kernels, measured seconds)
    for name in shapes:
        for variant, (flags, seconds, mfu_passes) in MEASURED_H100[name].items():
            ops = count(name, *row_settings(flags)[:2], micro_batches)
            passes = model_flops(name, micro_batches) / (mfu_passes * gpu.peak)
            figures += [(name, variant, "step", ops, seconds),
                        (name, variant, "passes", [op for op in ops if op.phase != "optimizer"], passes)]
    fitted = step_model.calibrate([(ops, seconds) for _, variant, _, ops, seconds in figures if variant == "now"],
                                  gpu, step_model.CALIBRATED.launch)
    print(f"fitted to the steps and passes of 'now' on {gpu.name}: {fitted}")
    print_ruled(f"{'shape':9s} {'variant':24s} {'what':7s} {'measured ms':>11s} {'model ms':>9s} {'error':>7s}")
    for name, variant, what, ops, seconds in figures:
        predicted = step_model.step_seconds(ops, gpu, fitted)
        print(f"{name:9s} {variant:24s} {what:7s} {seconds * 1e3:11.1f} {predicted * 1e3:9.1f} "
              f"{predicted / seconds - 1:+7.1%}")


def parse_args() -> argparse.Namespace:
    parser = cli.parser(__doc__)
    parser.add_argument("--device", default="h100", help=f"the GPU: {', '.join(step_model.PARTS)}, or any name with "
                                                         "--device-peak-tflops and --device-bandwidth")
    parser.add_argument("--device-peak-tflops", type=float, default=None, help="dense bf16 peak, TFLOP/s")
    parser.add_argument("--device-bandwidth", type=float, default=None, help="HBM bandwidth, TB/s")
    parser.add_argument("--shape", default="gpt-1.3b,gpt-350m", help="comma-separated, from gpt-1.3b, gpt-350m")
    parser.add_argument("--micro-batches", type=int, default=MICRO_BATCHES, help="micro-batches per step")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit the efficiencies to the H100 figures (meaningful at their commit) and stop")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    args.shape = args.shape.split(",")
    for name in args.shape:
        if name not in MEASURED_H100:
            parser.error(f"--shape {name} is unknown; use gpt-1.3b, gpt-350m or both, comma-separated.")
    try:
        args.gpu = step_model.gpu_part(args.device, args.device_peak_tflops, args.device_bandwidth)
    except ConfigError as error:
        parser.error(str(error))
    return args


def main() -> None:
    args = parse_args()
    print(f"megapipe counted: {COUNTED_ROOT} (commit {commit_of(COUNTED_ROOT)}), torch {torch.__version__}")
    if args.calibrate:
        calibrate(args.shape, args.micro_batches)
        return
    gpu, efficiency = args.gpu, step_model.CALIBRATED
    print(f"{gpu.name}: {gpu.peak / 1e12:.0f} TFLOP/s dense bf16, {gpu.bandwidth / 1e12:.2f} TB/s; efficiency "
          f"matmul and attention {efficiency.matmul:.3f}, memory {efficiency.memory:.3f}, "
          f"launch {efficiency.launch * 1e6:.0f} us a kernel; {args.micro_batches} micro-batches a step")
    report = {"device": gpu.name, "rows": {}}
    for row, flags in ROWS:
        report["rows"][row] = figures = {"flags": " ".join(flags)}
        model, fp8, problem = row_settings(flags)
        for name in args.shape if problem is None else ():
            started = time.perf_counter()
            try:
                ops = count(name, model, fp8, args.micro_batches)
            except UserError as error:
                problem = f"refused on the fake device: {str(error).splitlines()[0]}"
                break
            seconds = step_model.step_seconds(ops, gpu, efficiency)
            figures[name] = {"ms_per_step": seconds * 1e3,
                             "mfu": model_flops(name, args.micro_batches) / seconds / gpu.peak,
                             **step_model.per_micro_batch(ops, args.micro_batches),
                             "categories_ms": {category: s * 1e3 for category, s in
                                               step_model.seconds_by_category(ops, gpu, efficiency).items()}}
            print(f"  counted {row}, {name} in {time.perf_counter() - started:.0f} s", flush=True)
        if problem is not None:
            report["rows"][row] = {"flags": figures["flags"], "problem": problem}
        write_json(args.json, report)
    print_tables(report["rows"], args.shape, gpu)
    write_json(args.json, report)


def print_tables(rows: dict, shapes: list[str], gpu) -> None:
    now = rows["now"]
    print()
    print_ruled(f"{'row':34s} {'flags':36s}" + "".join(f" {name + ' ms':>13s} {'MFU':>6s} {'vs now':>6s}"
                                                       for name in shapes))
    for row, figures in rows.items():
        if "problem" in figures:
            print(f"{row:34s} {figures['flags']:36s} {figures['problem']}")
            continue
        print(f"{row:34s} {figures['flags']:36s}" + "".join(
            f" {figures[n]['ms_per_step']:13.1f} {figures[n]['mfu']:6.1%} "
            f"{now[n]['ms_per_step'] / figures[n]['ms_per_step']:6.2f}" for n in shapes))
    if gpu.name == step_model.PARTS["h100"][0]:
        print("measured on one H100 at commit 2568abb: " + ", ".join(
            f"{n} {MEASURED_H100[n]['now'][1] * 1e3:.0f} ms (the model of this code "
            f"{now[n]['ms_per_step'] / MEASURED_H100[n]['now'][1] / 1e3 - 1:+.1%})" for n in shapes))
    print("\nms per step by category, now")
    print_ruled(f"{'category':16s}" + "".join(f" {name:>10s}" for name in shapes))
    for category in step_model.CATEGORIES:
        print(f"{category:16s}" + "".join(f" {now[n]['categories_ms'][category]:10.1f}" for n in shapes))
    print("\nper micro-batch (forward and backward): kernels, allocations, GB allocated, GB moved")
    print_ruled(f"{'row':34s}" + "".join(f" {name:>34s}" for name in shapes))
    for row, figures in rows.items():
        if "problem" not in figures:
            print(f"{row:34s}" + "".join(
                f" {figures[n]['kernels']:7.0f} {figures[n]['allocations']:7.0f} {figures[n]['allocated'] / 1e9:9.1f} "
                f"{figures[n]['bytes'] / 1e9:9.1f}" for n in shapes))


if __name__ == "__main__":
    main()
