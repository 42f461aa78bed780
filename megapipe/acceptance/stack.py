"""The machine as megapipe meets it: software versions, compilers, optional packages, the device and
its peak, and the fusion backend that megapipe chooses by running each family."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sysconfig
from importlib import metadata

import torch

from megapipe import fusions
from megapipe.acceptance.record import Context, Record
from megapipe.parallel.launch import device_name
from megapipe.models.flops import device_peak_tflops

OPTIONAL = ("apex", "transformer_engine", "megatron.core", "datasets", "cvxpy", "wandb", "matplotlib",
            "sentencepiece", "tokenizers", "transformers")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def run(record: Record, context: Context) -> None:
    cuda = torch.version.cuda or "none"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    record.add("software", "passed", f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {cuda}, "
                                     f"cuDNN {cudnn}, NCCL {nccl}), Triton {_version('triton')}, "
                                     f"transformers {_version('transformers')}")
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    has_headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    record.add("build tools", "passed", f"C compiler {compiler or 'none'}; Python headers "
                                        f"{'present' if has_headers else 'absent'} (Triton builds its launcher "
                                        "with both)")
    record.add("optional packages", "passed", ", ".join(f"{m} {'yes' if _present(m) else 'no'}" for m in OPTIONAL))
    device = context.device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        peak = device_peak_tflops(device_name(device))
        record.add("device", "passed", f"{device_name(device)}, {props.multi_processor_count} SMs, "
                                       f"{props.total_memory / 2 ** 30:.1f} GiB, dense bf16 peak "
                                       f"{peak if peak is not None else 'unknown'} TFLOP/s", peak_tflops=peak)
        if peak is None:
            record.add("device peak known", "failed", f"{device_name(device)} is not in megapipe.models.flops."
                                                      "KNOWN_PEAK_TFLOPS; MFU needs --device-peak-tflops")
    else:
        record.add("device", "passed", f"{device} (dry run)")
    chosen = fusions.select_backend("auto", device)
    wanted = "triton" if device.type == "cuda" else "eager"
    outcome = "passed" if chosen.name in (wanted, "apex") else "failed"
    record.add("fusion backend", outcome, f"{chosen.name} ({chosen.reason})", backend=chosen.name)
