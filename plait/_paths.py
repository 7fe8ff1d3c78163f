"""Keep a source checkout's top-level folders from shadowing installed packages.

The repository root holds `engine/`, `server/` and `kernels/`, which install as
`plait.engine`, `plait.server` and `plait.kernels` (docs/ARCHITECTURE.md). `python -m ...`,
`python -c ...` and `PYTHONPATH=<checkout>` put the root itself on `sys.path`, where those
folders would also import as the top-level modules `engine`, `server` and `kernels`, hiding
installed distributions of the same name: transformers >= 5.25 depends on the PyPI package
`kernels` and fails to load any model when `import kernels` finds this repository's folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def drop_checkout_root() -> None:
    """Remove the checkout's root from `sys.path` (entries naming it, "" included when it is
    the working directory). A no-op for an installed wheel, whose `plait/kernels` is a real
    folder rather than the checkout's symlink. Call it after `plait` is imported: its
    sub-packages resolve through `plait.__path__`, never through `sys.path`."""
    if not (_PACKAGE / "kernels").is_symlink():
        return
    root = _PACKAGE.parent
    sys.path[:] = [entry for entry in sys.path if not _is(entry, root)]


def _is(entry: str, root: Path) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == root
    except OSError:
        return False
