"""A minimal MAP base image built without any registry: debootstrap (minbase) + `podman import`.

Debian bookworm's python3 is 3.11, which the holoscan-cu13 4.2 / torch cp311 wheels need, and its glibc
(2.36) satisfies holoscan's manylinux_2_35 wheels. The image holds bash, jq (tools script) and python3-venv:
~130 MB, against the ~5 GB CUDA devel images the official packager starts from.

    python -m medserve.packaging.base [TAG]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from medserve.errors import PackagingError
from medserve.packaging import engine, layout, registry

logger = logging.getLogger("medserve.packaging.base")

PACKAGES = ("python3", "python3-venv", "jq")
_TRIM = ("var/lib/apt/lists", "var/cache/apt", "usr/share/doc", "usr/share/man", "usr/share/info",
         "usr/share/locale")


def image_exists(tag: str) -> bool:
    argv = [*engine.base_command("podman"), "image", "exists", tag]
    return subprocess.run(argv, capture_output=True).returncode == 0


def build_base_image(tag: str = layout.DEFAULT_BASE_IMAGE, suite: str = "bookworm",
                     mirror: str = "http://deb.debian.org/debian") -> str:
    registry.image_name(tag)  # before minutes of debootstrap; podman import refuses a bad name only at its end
    for tool in ("debootstrap", "podman"):
        if not engine.have(tool):
            raise PackagingError(f"building the base image needs {tool} (apt-get install {tool})")
    with tempfile.TemporaryDirectory(prefix="medserve-base-", dir="/var/tmp") as temp:
        root = Path(temp) / "root"
        logger.info("debootstrap %s into %s", suite, root)
        engine.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, str(root),
                    mirror], f"debootstrap {suite}", timeout=1800)
        for relative in _TRIM:  # apt lists and docs are dead weight in every layer above
            target = root / relative
            if target.is_dir():
                shutil.rmtree(target)
                target.mkdir()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        result = subprocess.run([*engine.base_command("podman"), "import", "--change", 'CMD ["/bin/bash"]',
                                 "-", tag], stdin=tar.stdout, capture_output=True, text=True)
        tar.wait()
        if result.returncode != 0 or tar.returncode != 0:
            raise PackagingError(f"podman import of {tag} failed: {result.stderr.strip()[-300:]}")
    logger.info("base image %s ready", tag)
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m medserve.packaging.base",
                                     description="Build the minimal MAP base image (debootstrap + podman import).")
    parser.add_argument("tag", nargs="?", default=layout.DEFAULT_BASE_IMAGE,
                        help=f"image tag (default {layout.DEFAULT_BASE_IMAGE})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        print(build_base_image(args.tag))
    except PackagingError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
