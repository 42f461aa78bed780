"""Install the torchrun hook: a ``.pth`` line that Python runs at every start-up in this environment.

The line costs a string comparison in every other process; only when the program is torchrun
(``torchrun`` or ``python -m ...``) does it import ``megapipe.launcher.torchrun_hook``, which
checks the module and otherwise imports nothing. A megapipe uninstalled later leaves a line that
does nothing. ``install.sh`` runs ``python -m megapipe.launcher.site_hook``.

    python -m megapipe.launcher.site_hook            # into this environment's site-packages
    python -m megapipe.launcher.site_hook DIRECTORY  # into another site directory
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

PTH_NAME = "megapipe_torchrun.pth"  # after "__editable__..." in the order site reads .pth files
PTH_LINE = ('import sys; exec("try:\\n from megapipe.launcher.torchrun_hook import install\\nexcept ImportError:\\n'
            ' pass\\nelse:\\n install()") if sys.argv[:1] and sys.argv[0].endswith(("torchrun", "-m")) else None\n')


def install(site_dir: str | Path) -> Path:
    """Write the hook's ``.pth`` into ``site_dir``; its path."""
    path = Path(site_dir) / PTH_NAME
    path.write_text(PTH_LINE)
    return path


def main(argv: list[str]) -> None:
    site_dir = argv[0] if argv else sysconfig.get_paths()["purelib"]
    print(f"megapipe's torchrun hook: {install(site_dir)}")


if __name__ == "__main__":
    main(sys.argv[1:])
