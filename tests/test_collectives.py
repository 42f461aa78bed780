"""The collectives whose names differ between torch versions are named in megapipe/parallel/collectives.py only
(torch 2.13's ``reduce_scatter_single`` / ``all_gather_single`` are ``reduce_scatter_tensor`` /
``all_gather_into_tensor`` in torch 2.11, the GPU machines' stack)."""

import pathlib
import re

import megapipe

VERSIONED = re.compile(r"\b(reduce_scatter_single|all_gather_single|reduce_scatter_tensor|all_gather_into_tensor)\b")


def test_version_dependent_collectives_are_named_in_one_module():
    package = pathlib.Path(megapipe.__file__).parent
    naming = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                    if VERSIONED.search(path.read_text()))
    assert naming == ["parallel/collectives.py"]
