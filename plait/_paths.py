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


# In a checkout, a folder that holds nothing but a `plait` symlink to the checkout's package.
IMPORT_ROOT = ".import-root"


def drop_checkout_root() -> None:
    """Take the checkout's root out of `sys.path` (entries naming it, "" included when it is
    the working directory): each such entry becomes the checkout's `.import-root/`, which
    holds only `plait`, so this checkout's `plait` still imports first (in a spawned child
    too: it inherits `sys.path`, and would otherwise import whatever `plait` is installed,
    e.g. another checkout's editable install) while `engine`, `server` and `kernels` no
    longer import as top-level modules. A no-op for an installed wheel, whose
    `plait/kernels` is a real folder rather than the checkout's symlink. Call it after
    `plait` is imported: its sub-packages resolve through `plait.__path__`."""
    if not (_PACKAGE / "kernels").is_symlink():
        return
    root = _PACKAGE.parent
    import_root = root / IMPORT_ROOT
    keep = (import_root / "plait").is_dir()
    entries: list[str] = []
    for entry in sys.path:
        if not _is(entry, root):
            entries.append(entry)
        elif keep and str(import_root) not in entries:
            entries.append(str(import_root))
    sys.path[:] = entries


def _is(entry: str, root: Path) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == root
    except OSError:
        return False
