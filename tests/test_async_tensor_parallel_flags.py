"""``--async-tensor-parallel`` (sequence parallelism's collective matmuls through torch's symmetric memory) is
refused in one sentence where it cannot run: without sequence parallelism, with the overlap turned off, and on
a device or build without symmetric memory (every CPU run), each naming the fix."""

from __future__ import annotations

import pytest
import torch

from megapipe.cli.parse import parse_run
from megapipe.errors import ConfigError
from megapipe.tensor_parallel import collective_matmul
from megapipe.tensor_parallel.collective_matmul import symmetric_memory_problem, use_symmetric_memory

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("flags", [["--tensor-model-parallel-size", "2"],
                                   ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--no-async-tensor-model-parallel-allreduce"]])
def test_without_sequence_parallel_overlap_the_flag_is_refused(flags):
    with pytest.raises(ConfigError, match=r"needs --sequence-parallel and the overlap that "
                                          r"--no-async-tensor-model-parallel-allreduce turns off"):
        parse_run("gpt", flags + ["--async-tensor-parallel"], world_size=2)


def test_a_device_without_symmetric_memory_is_refused_and_the_rings_stay():
    assert symmetric_memory_problem(torch.device("cpu")) == "this run computes on the cpu"
    with pytest.raises(ConfigError) as refused:
        use_symmetric_memory(True, torch.device("cpu"))
    assert str(refused.value) == ("--async-tensor-parallel needs torch's symmetric memory on CUDA GPUs, but this "
                                  "run computes on the cpu; drop the flag: sequence parallelism's collective "
                                  "matmuls then run as point-to-point rings.")
    assert collective_matmul._symmetric_groups is None  # nothing half-chosen: the rings run
    parse_run("gpt", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--async-tensor-parallel"],
              world_size=2)  # the flags themselves are accepted; the device is checked when the run starts
