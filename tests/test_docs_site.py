"""The documentation builds as a site without a broken link, and README.md stays the entry page that
leads into it (docs/tests.md, "The documentation site")."""

import pathlib
import re

import pytest
from launch_helpers import REPO

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(REPO)
TEST_COMMAND = "python -m pytest -q -n 3"
SET_UP = ("bash install.sh && python pretrain_gpt.py", TEST_COMMAND, "python -m pytest -q -m unit")


def test_the_site_builds_strictly_so_a_broken_link_or_a_page_left_out_of_the_nav_fails(tmp_path):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    build(load_config(config_file=str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True))
    assert (tmp_path / "site" / "troubleshooting" / "index.html").exists()


def test_the_readme_is_a_short_entry_page_with_the_set_up_commands_and_links_that_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md is an entry page: move details to a docs/ page"
    for command in SET_UP:
        assert command in readme, f"README.md lost the set-up command {command!r}"
    assert f"\n{TEST_COMMAND} " in (ROOT / ".ci" / "run").read_text(), "CI must run the README's test command"
    targets = {target.split("#")[0] for target in re.findall(r"\]\(([^)]+)\)", readme) if "://" not in target}
    assert {target for target in targets if not (ROOT / target).exists()} == set()
    linked = {pathlib.Path(target).name for target in targets if target.startswith("docs/")}
    assert linked >= {path.name for path in (ROOT / "docs").glob("*.md")}, "every docs page has a row in the README"
