"""Fill a --wheel-dir for offline MAP builds: `pip download` of exactly the requirements the build installs,
with this machine's pip configuration (its indexes, find-links and certificates)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from medserve.errors import PackagingError
from medserve.packaging.config import read_app_config
from medserve.packaging.context import app_requirements
from medserve.packaging.manifest import find_app


def download_wheels(requirements: list[str], cache_root: Path) -> Path:
    """Wheels for `requirements` under cache_root/wheels-<hash>; downloaded once, reused after."""
    text = "\n".join(requirements) + "\n"
    target = Path(cache_root) / f"wheels-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if (target / ".complete").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    (target / "requirements.txt").write_text(text)
    # For the CPU variant the configured index must offer torch+cpu (a local wheel, or
    # extra-index-url https://download.pytorch.org/whl/cpu in pip.conf).
    result = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(target), "-r",
                             str(target / "requirements.txt")], capture_output=True, text=True)
    if result.returncode != 0:
        raise PackagingError(f"pip download into {target} failed: {result.stderr.strip()[-500:]}")
    (target / ".complete").write_text("")
    return target


def wheels_for_app(application: Path, config: Path, cache_root: Path) -> Path:
    return download_wheels(app_requirements(find_app(application), read_app_config(config)), cache_root)
