"""A bundle's own Python code (its `scripts/` package) importable while the bundle is loaded.

Zoo bundles that ship code name it in their config (`network_def: {_target_: scripts.net.Net}`, `$import
scripts.utils`), and MONAI's own workflow runs them with the bundle root on sys.path. Every such bundle calls its
package `scripts`, and the server loads many bundles in one process: so the bundle root is on sys.path only while
its config is parsed and its components built, and the modules imported from it then are taken out of
sys.modules afterwards (the objects built from them keep them alive), putting back any module of the same name
that was there before. Loading such bundles is serialized.

So code that imports only while it runs (an `import scripts.helpers` inside `forward`) finds no `scripts` at
inference time; every import has to happen while the bundle loads, as module-level imports and `$import` do.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from types import ModuleType

_LOADING = threading.Lock()
log = logging.getLogger("medserve.bundle")


def top_level_modules(root: Path) -> set[str]:
    """Names `import` finds in `root`: its packages (folders with __init__.py) and modules (.py files), except the
    standard library's (a bundle must not replace them for the whole process)."""
    if not root.is_dir():
        return set()
    names = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} | {p.stem for p in root.glob("*.py")}
    return names - sys.stdlib_module_names


@contextlib.contextmanager
def bundle_code(root: Path) -> Iterator[None]:
    """Within this context, the bundle at `root` can import its own modules by their top-level names, except those
    named like an installed package the process has imported (a `torch/` in the bundle folder): taking torch out
    of sys.modules while the bundle loads would break everything else in the process that uses it."""
    names = top_level_modules(root)
    if names:
        installed = set(metadata.packages_distributions())
        clashing = sorted(name for name in names if name in installed and name in sys.modules)
        if clashing:
            log.warning("bundle %s: its top-level modules %s have the names of installed packages the process "
                        "uses; they are not imported from the bundle", root.resolve().name, ", ".join(clashing))
        names -= set(clashing)
    if not names:
        yield
        return
    with _LOADING:
        shadowed = _take_modules(names)
        sys.path.insert(0, str(root))
        try:
            yield
        finally:
            sys.path.remove(str(root))
            _take_modules(names)
            sys.modules.update(shadowed)


def _take_modules(names: set[str]) -> dict[str, ModuleType]:
    """Remove the modules `names` and their submodules from sys.modules; what was removed."""
    taken = {name: module for name, module in list(sys.modules.items())
             if name.split(".", 1)[0] in names}
    for name in taken:
        del sys.modules[name]
    return taken
