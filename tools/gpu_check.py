"""GPU acceptance in one command (``bash tools/gpu_check.sh``): the CUDA tests, then the single-device
benchmark of GPT-350M and GPT-1.3B at sequence 2048 in bf16, summed up in one table.

On a machine without a CUDA device it says so and exits 0. It needs no network: Hugging Face
runs offline, and megatron-core is compared only when it is installed (a wheel can be copied to
the machine and installed from the file). Extra arguments go to the benchmark, e.g.
``--micro-batch-size 2``. Raw outputs are kept in ``--out`` (default ``gpu-check/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = "gpt-350m,gpt-1.3b"


def cuda_device() -> str | None:
    """The CUDA device's name, or None (asked in a child process, so this one never touches CUDA)."""
    probe = ("from megapipe.distributed import default_device; import torch; d = default_device(); "
             "print(torch.cuda.get_device_name(d) if d.type == 'cuda' else '')")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=_env())
    return result.stdout.strip() or None


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_tests(out: str) -> list[tuple[str, str]]:
    """(test, outcome) of every test marked ``cuda``."""
    report = os.path.join(out, "cuda-tests.xml")
    subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", f"--junitxml={report}", "tests"],
                   cwd=REPO, env=_env())
    outcomes = []
    for case in ElementTree.parse(report).iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped")
        outcome = "FAILED" if failed else f"skipped: {skipped.get('message', '')}" if skipped is not None else "passed"
        outcomes.append((case.get("name"), outcome))
    return outcomes


def run_benchmark(out: str, extra: list[str]) -> dict:
    report = os.path.join(out, "bench_single_device.json")
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_single_device.py"), "--shape", SHAPES,
                    "--json", report, *extra], cwd=REPO, env=_env())
    if not os.path.exists(report):
        return {}
    with open(report) as f:
        return json.load(f)


def print_table(device: str, tests: list[tuple[str, str]], bench: dict) -> None:
    passed = sum(outcome == "passed" for _, outcome in tests)
    failed = [name for name, outcome in tests if outcome == "FAILED"]
    print(f"\n==== GPU check on {device} (torch {bench.get('torch', '?')}) ====")
    print(f"cuda tests: {passed} passed, {len(failed)} failed, {len(tests) - passed - len(failed)} skipped"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    header = f"{'model':10s} {'system':44s} {'ms/step':>9s} {'tokens/s':>10s} {'MFU':>6s} {'vs HF':>6s} {'peak GiB':>8s}"
    print(header + "\n" + "-" * len(header))
    for shape, rows in bench.get("shapes", {}).items():
        for row in rows:
            if "error" in row:
                print(f"{shape:10s} {row['system']:44s} not run: {row['error']}")
                continue
            vs_hf = f"{row['vs_hf']:6.2f}" if row["vs_hf"] is not None else f"{'-':>6s}"
            peak = f"{row['peak_gib']:8.1f}" if row["peak_gib"] is not None else f"{'-':>8s}"
            print(f"{shape:10s} {row['system']:44s} {row['ms_per_step']:9.1f} {row['tokens_per_s']:10.0f} "
                  f"{row['mfu']:6.1%} {vs_hf} {peak}")
    if not bench:
        print("benchmark: no result (see its output above)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "gpu-check"), help="folder for the raw outputs")
    args, extra = parser.parse_known_args()
    device = cuda_device()
    if device is None:
        print("tools/gpu_check.sh needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False): "
              "nothing to check here.")
        return 0
    os.makedirs(args.out, exist_ok=True)
    tests = run_tests(args.out)
    bench = run_benchmark(args.out, extra)
    print_table(device, tests, bench)
    return 1 if any(outcome == "FAILED" for _, outcome in tests) or not bench else 0


if __name__ == "__main__":
    sys.exit(main())
