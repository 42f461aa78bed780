"""Every error a user can fix is a ``UserError``, and every entry point reports one the same way:
``error: <message>`` once on stderr, exit status 2, no traceback (``megapipe.errors``)."""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import pytest

import megapipe
from megapipe import errors
from megapipe.errors import USAGE_ERROR, ConfigError, UserError, reports_user_errors
from launch_helpers import REPO

pytestmark = pytest.mark.unit

ROOT = Path(REPO)
# every script with a main of its own (tools/gpu_check.py only imports the acceptance's)
ENTRY_POINTS = [path for path in sorted(ROOT.glob("tools/*.py")) if "\ndef main(" in path.read_text()] + [
    ROOT / "megapipe/training/cli.py", ROOT / "megapipe/acceptance/__main__.py",
    ROOT / "megapipe/cluster/service/backends/slurm_testbed.py"]
USER_ERROR_NAMES = {name for name, value in vars(errors).items()
                    if isinstance(value, type) and issubclass(value, UserError)}


def test_the_wrapper_reports_a_user_error_once_and_returns_2(capsys):
    @reports_user_errors
    def main(flag):
        raise ConfigError(f"--flag {flag} is wrong; use --flag 1.")

    assert main(3) == USAGE_ERROR == 2
    captured = capsys.readouterr()
    assert captured.err == "error: --flag 3 is wrong; use --flag 1.\n" and captured.out == ""


def test_the_wrapper_leaves_other_errors_and_results_alone():
    assert reports_user_errors(lambda: 0)() == 0
    seen = []
    wrapped = reports_user_errors(report=seen.append)(lambda: (_ for _ in ()).throw(KeyError("bug")))
    with pytest.raises(KeyError):
        wrapped()
    assert seen == []


def test_every_error_kind_a_user_fixes_is_a_user_error():
    """The error types of the library, found by walking it: each is a UserError, except the ones
    that are bugs or transient states (listed, with why)."""
    not_user = {
        "PipelineTimeout",  # becomes PeerLost (a UserError) once the roll call names who is gone
        "DistributedFailure",  # the test harness's report of a failed rank
        "GeneratorDeviceMismatch",  # a library bug the fake device exists to catch
        "ServiceStopped",  # control flow: leaves the scheduler's round loop at shutdown
        "Refusal",  # an HTTP answer of a service to a client (json_http.py), never an entry point's exit
        "QueueFull",  # control flow: the text-generation server answers 503
        "ReplicaLost",  # control flow: a fault-tolerant replica discards the step and asks for a new quorum
    }
    found = {}
    for module in pkgutil.walk_packages(megapipe.__path__, "megapipe."):
        path = Path(megapipe.__file__).parent.joinpath(*module.name.split(".")[1:])
        source = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith(("Error", "Exception", "Unavailable",
                                                                                "Lost", "Timeout", "Mismatch",
                                                                                "Failure", "Package"))
                                                      for b in node.bases):
                found[node.name] = module.name
    classes = {name: getattr(__import__(module, fromlist=[name]), name) for name, module in found.items()}
    wrong = sorted(name for name, cls in classes.items()
                   if name not in not_user and not issubclass(cls, UserError))
    assert not wrong, f"error types a user fixes that are not UserError: {wrong}"
    assert not_user <= set(classes), "the exceptions listed no longer exist; update the list"


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda p: p.name)
def test_entry_points_use_the_one_wrapper(path):
    """No entry point catches its own tuple of user errors: its ``main`` (or what it runs) is
    decorated with ``reports_user_errors``, and no handler names a UserError type."""
    tree = ast.parse(path.read_text())
    functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]
    decorated = [f.name for f in functions if any("reports_user_errors" in ast.unparse(d) for d in f.decorator_list)]
    assert decorated, f"{path.name}: decorate its main with megapipe.errors.reports_user_errors"
    handlers = [node for node in ast.walk(tree) if isinstance(node, ast.ExceptHandler) and node.type is not None]
    caught = {name.id if isinstance(name, ast.Name) else getattr(name, "attr", "")
              for handler in handlers
              for name in (handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type])}
    assert not caught & (USER_ERROR_NAMES | {"GenerationError", "NamespacesUnavailable", "SlurmUnavailable"}), \
        f"{path.name} catches {sorted(caught & USER_ERROR_NAMES)} itself"
