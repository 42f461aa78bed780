"""Schedule names live in the schedule descriptors alone (``megapipe/schedules/catalog``): a module
elsewhere that wants a schedule asks the registry for a property (``default_schedule``, ``names_where``,
a descriptor's field), so adding, renaming or changing a schedule touches its own file only.

Read from the source: a string literal equal to a registered name, or a ``--pipeline-schedule NAME`` in
any literal (a command or a suggestion in an error), outside docstrings, is a name written twice.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import megapipe
from megapipe.schedules.catalog import schedule_names

pytestmark = pytest.mark.unit

PACKAGE = Path(megapipe.__file__).parent
CATALOG = PACKAGE / "schedules" / "catalog"
NAMES = set(schedule_names())
FLAG = re.compile(r"--pipeline-schedule (%s)\b" % "|".join(re.escape(name) for name in sorted(NAMES, key=len,
                                                                                                reverse=True)))


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, kinds) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def names_written(source: str) -> list[str]:
    """The schedule names ``source`` writes as values: ``'1f1b'`` or ``"--pipeline-schedule 2bw"``."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in NAMES:
                found.append(f"line {node.lineno}: {node.value!r}")
            found.extend(f"line {node.lineno}: {match.group(0)!r}" for match in FLAG.finditer(node.value))
    return found


def test_the_check_sees_a_name_and_a_suggested_flag():
    assert len(names_written('x = "1f1b"\nraise E("use --pipeline-schedule zbv instead")\n')) == 2
    assert names_written('"""Docs may speak of 1f1b and --pipeline-schedule zbv."""\n') == []


def test_no_module_outside_the_descriptors_names_a_schedule():
    written = {str(path.relative_to(PACKAGE)): names_written(path.read_text())
               for path in PACKAGE.rglob("*.py") if CATALOG not in path.parents}
    assert {path: names for path, names in written.items() if names} == {}
