"""Optional packages: imported where a feature uses them, never at module level of the training,
inference or acceptance paths, so megapipe runs on a bare GPU image (torch, transformers, tokenizers,
sentencepiece, numpy, tqdm) and a missing package is one sentence naming it and the feature."""

from __future__ import annotations

import importlib
import types

from megapipe.errors import ConfigError


class MissingPackage(ConfigError):
    """A feature was asked for whose package is not installed."""


def require(module: str, feature: str, package: str | None = None) -> types.ModuleType:
    """``module`` imported, or MissingPackage saying that ``feature`` needs ``package`` (default: ``module``)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = package or module
        raise MissingPackage(f"{feature} needs the {package} package, which is not installed here; "
                             f"pip install {package}, or leave that feature out.") from error


class LazyModule:
    """A module imported at its first attribute use, for code that names it throughout
    (``cp = LazyModule("cvxpy", "Gavel's LP policies")`` then ``cp.Variable(...)``)."""

    def __init__(self, module: str, feature: str, package: str | None = None):
        self._where = (module, feature, package)

    def __getattr__(self, name: str):
        return getattr(require(*self._where), name)
