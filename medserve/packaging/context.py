"""Assemble the build context: app, libraries, models, manifests, tools script, pip inputs, Containerfile."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import medserve
from medserve.errors import PackagingError
from medserve.packaging import layout
from medserve.packaging.config import AppConfig
from medserve.packaging.containerfile import render
from medserve.packaging.manifest import AppSource

logger = logging.getLogger("medserve.packaging.context")

HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# Holoscan (holoscan-cu13) loads libcudart.so.13 even on CPU; a clean image has no CUDA runtime.
CUDA_RUNTIME_PIN = "nvidia-cuda-runtime==13.0.*"
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".git", ".pytest_cache", "*.egg-info")


@dataclass(frozen=True)
class BuildInputs:
    app: AppSource
    config: AppConfig
    models: dict[str, Path]
    app_json: dict
    pkg_json: dict
    tag: str
    base_image: str
    variant: str  # "cpu" | "cuda"
    holoscan_version: str
    sdk_version: str
    wheel_dir: Path | None = None
    docs: Path | None = None
    uid: int = 1000
    gid: int = 1000


def app_requirements(app: AppSource, config: AppConfig) -> list[str]:
    """requirements.txt of the app dir plus app.yaml's pip-packages, as the official packager merges them."""
    lines: list[str] = []
    path = app.directory / "requirements.txt"
    if path.is_file():
        lines += [line.strip() for line in path.read_text().splitlines()]
    lines += config.pip_packages or []
    lines = [line for line in lines if line and not line.startswith("#")]
    if any(line.lower().startswith(("holoscan", "monai-deploy-app-sdk")) for line in lines) and not any(
        line.lower().startswith("nvidia-cuda-runtime") for line in lines
    ):
        lines.append(CUDA_RUNTIME_PIN)
    return lines


def _medserve_packages() -> list[Path]:
    """medserve/ and operators/ as imported here: the app imports both, and they are not on PyPI."""
    packages = [Path(medserve.__file__).parent]
    try:
        import operators  # the project's App SDK operators package

        if getattr(operators, "__file__", None):
            packages.append(Path(operators.__file__).parent)
    except ImportError:
        logger.debug("no 'operators' package importable; only medserve/ goes into %s", layout.LIB_DIR)
    return packages


def _link_tree(source: Path, target: Path) -> None:
    """Hard-link a wheel directory into the context (GBs; copying would double the build time)."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()):
        if entry.is_file():
            try:
                os.link(entry, target / entry.name)
            except OSError:
                shutil.copy2(entry, target / entry.name)


def tools_script() -> str:
    """The official entrypoint script, byte for byte (holoscan-cli ships it as package data)."""
    try:
        return resources.files("holoscan_cli.packager").joinpath("templates/tools.sh").read_text()
    except (ModuleNotFoundError, FileNotFoundError) as error:
        raise PackagingError("holoscan-cli==4.2.0 is needed for the MAP tools script (pip install it)") from error


def deps_fingerprint(requirements: list[str], wheel_dir: Path | None, variant: str) -> str:
    """Goes into the pip RUN line so that the layer cache notices new pins or wheels."""
    digest = hashlib.sha256("\n".join(requirements).encode() + variant.encode())
    if wheel_dir is not None:
        for wheel in sorted(wheel_dir.iterdir()):
            digest.update(f"{wheel.name}:{wheel.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def write_context(inputs: BuildInputs, directory: Path) -> Path:
    """Write everything the Containerfile copies; returns the Containerfile path."""
    app_target = directory / "app"
    shutil.copytree(inputs.app.directory, app_target, ignore=_IGNORE)
    lib = directory / "lib"
    lib.mkdir()
    for package in _medserve_packages():
        shutil.copytree(package, lib / package.name, ignore=_IGNORE)
    models = directory / "models"
    models.mkdir()
    for name, source in inputs.models.items():
        if source.is_file():
            (models / name).mkdir()
            shutil.copy2(source, models / name / source.name)
        else:
            shutil.copytree(source, models / name, ignore=_IGNORE)
    if inputs.docs is not None:
        shutil.copytree(inputs.docs, directory / "docs", ignore=_IGNORE)
    (directory / "map").mkdir()
    (directory / "map" / "app.json").write_text(json.dumps(inputs.app_json))
    (directory / "map" / "pkg.json").write_text(json.dumps(inputs.pkg_json))
    shutil.copy2(inputs.config.path, directory / "app.config")
    (directory / "tools").write_text(tools_script())
    (directory / "tools").chmod(0o755)

    pip_dir = directory / "pip"
    pip_dir.mkdir()
    requirements = app_requirements(inputs.app, inputs.config)
    (pip_dir / "requirements.txt").write_text("\n".join(requirements) + "\n")
    # The CA bundle is mounted into the pip step only (networks that re-sign TLS); it is never an image layer.
    if HOST_CA_BUNDLE.is_file():
        shutil.copy2(HOST_CA_BUNDLE, pip_dir / "ca.crt")
    else:
        (pip_dir / "ca.crt").write_text("")
    if inputs.wheel_dir is not None:
        _link_tree(inputs.wheel_dir, pip_dir / "wheels")

    containerfile = directory / "Containerfile"
    containerfile.write_text(
        render(inputs, has_docs=inputs.docs is not None,
               fingerprint=deps_fingerprint(requirements, inputs.wheel_dir, inputs.variant))
    )
    return containerfile
