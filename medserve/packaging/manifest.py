"""app.json and pkg.json, field for field as holoscan-cli 4.2 writes them (packager/config_reader.py,
packager/arguments.py), plus the model scan the packager does on `-m`."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from medserve.bundle.layout import BundleLayout
from medserve.errors import BundleError, PackagingError
from medserve.packaging import layout
from medserve.packaging.config import AppConfig

SDK = "monai-deploy"
SDK_PACKAGE = "monai-deploy-app-sdk"
# The first is what an app that names none gets (monai-deploy-app-sdk 4.0 depends on holoscan-cu13).
HOLOSCAN_PACKAGES = ("holoscan-cu13", "holoscan-cu12", "holoscan")
# --platform -> (OCI platform, platformConfig): the names holoscan-cli 4.2 accepts and its mappings
# (common/constants.py SDK.PLATFORM_ARCH_MAPPINGS and SDK.INTERNAL_PLATFORM_MAPPINGS).
PLATFORMS = {
    "jetson": ("linux/arm64", "igpu"),
    "igx-igpu": ("linux/arm64", "igpu"),
    "igx-dgpu": ("linux/arm64", "dgpu"),
    "sbsa": ("linux/arm64", "dgpu"),
    "x86_64": ("linux/amd64", "dgpu"),
}


@dataclass(frozen=True)
class AppSource:
    """The application as the packager sees it: a directory with app.py (or __main__.py)."""

    directory: Path
    entry: str  # "app.py" (PythonFile) or "" (PythonModule: the directory has __main__.py)

    @property
    def command(self) -> str:
        # The official manifest stores the command as a JSON string; tools.sh parses it with `fromjson`.
        target = layout.APP_DIR if not self.entry else os.path.join(layout.APP_DIR, self.entry)
        return json.dumps([layout.PYTHON_EXECUTABLE, target])


def find_app(path: Path) -> AppSource:
    path = Path(path)
    if path.is_file():
        if path.suffix != ".py":
            raise PackagingError(f"application {path} is not a Python file (expected app.py or a directory)")
        return AppSource(path.parent, path.name)
    if not path.is_dir():
        raise PackagingError(f"application directory not found: {path}")
    if (path / "__main__.py").is_file():
        return AppSource(path, "")
    if (path / "app.py").is_file():
        return AppSource(path, "app.py")
    raise PackagingError(f"application directory {path} has no app.py (nor __main__.py)")


def _is_bundle(path: Path) -> bool:
    """A folder with configs/ is meant as a bundle, even one that lacks models/ or metadata.json: it is checked,
    not packaged as a folder of two "models"."""
    return (path / "configs").is_dir()


def _checked_bundle(path: Path) -> Path:
    """A bundle as the app will load it: a MAP built from one without weights or an inference config would only
    fail when it runs."""
    try:
        BundleLayout.find(path)
    except BundleError as error:
        raise PackagingError(f"models path {path}: not a usable MONAI bundle ({error})") from error
    return path


def scan_models(path: Path) -> dict[str, Path]:
    """Model name -> source path, as holoscan_cli/packager/models.py scans `-m`.

    One deviation, on purpose: a MONAI bundle directory (configs/ + models/) is one model named after the
    directory. The official scan would turn its configs/ and models/ subfolders into two "models".
    """
    path = Path(path)
    if not path.exists():
        raise PackagingError(f"models path not found: {path}")
    if path.is_file():
        return {path.stem: path}
    if _is_bundle(path):
        return {path.resolve().name: _checked_bundle(path)}
    if not path.is_dir():
        raise PackagingError(f"models path {path} is neither a file nor a folder; expected a bundle folder, a "
                             "folder of bundles or a model file")
    models: dict[str, Path] = {}
    for entry in sorted(os.listdir(path)):
        if (path / entry).is_file():
            models[path.resolve().stem] = path
        elif (path / entry).is_dir():
            models[entry] = _checked_bundle(path / entry) if _is_bundle(path / entry) else path / entry
    if not models:
        raise PackagingError(f"models path {path} is an empty directory")
    return models


def _parsed(line: str) -> Requirement | None:
    """A requirement line as pip reads it (its comment and --hash options left out); None for options (-e,
    --index-url) and URLs."""
    try:
        return Requirement(re.split(r"\s#|\s--hash", line, maxsplit=1)[0].strip())
    except InvalidRequirement:
        return None


def named(requirements: list[str], names: tuple[str, ...]) -> Requirement | None:
    """The first requirement naming one of `names` (compared as pip does: case, '-', '_' and '.' alike)."""
    wanted = {canonicalize_name(name) for name in names}
    for line in requirements:
        requirement = _parsed(line)
        if requirement is not None and canonicalize_name(requirement.name) in wanted:
            return requirement
    return None


def _exact_version(requirement: Requirement | None) -> str | None:
    specifiers = list(requirement.specifier) if requirement is not None else []
    if len(specifiers) == 1 and specifiers[0].operator in {"==", "==="} and "*" not in specifiers[0].version:
        return specifiers[0].version
    return None


@dataclass(frozen=True)
class SdkPin:
    """One SDK package of the image: the version its labels and app.json record."""

    name: str
    version: str | None  # None: neither pinned by the app nor installed here
    pinned: bool  # the app's requirements pin exactly this version


def sdk_pins(requirements: list[str]) -> tuple[SdkPin, SdkPin]:
    """(holoscan, monai-deploy-app-sdk): the app's exact pins, else the version installed here (which the build
    then pins, as the official Dockerfile installs `monai-deploy-app-sdk=={version}`)."""

    def pin(names: tuple[str, ...]) -> SdkPin:
        requirement = named(requirements, names)
        name = requirement.name if requirement is not None else names[0]
        exact = _exact_version(requirement)
        if exact is not None:
            return SdkPin(name, exact, True)
        try:
            return SdkPin(name, metadata.version(name), False)
        except metadata.PackageNotFoundError:
            return SdkPin(name, None, False)

    return pin(HOLOSCAN_PACKAGES), pin((SDK_PACKAGE,))


def sdk_versions(requirements: list[str]) -> tuple[str, str]:
    """(holoscan, monai-deploy-app-sdk) versions recorded in the labels and app.json."""
    holoscan, sdk = sdk_pins(requirements)
    return holoscan.version or "unknown", sdk.version or "unknown"


def app_manifest(config: AppConfig, app: AppSource, sdk_version: str, timeout: int = layout.TIMEOUT) -> dict[str, Any]:
    return {
        "apiVersion": layout.API_VERSION,
        "command": app.command,
        "environment": {
            "HOLOSCAN_APPLICATION": layout.APP_DIR,
            "HOLOSCAN_INPUT_PATH": layout.INPUT_DIR,
            "HOLOSCAN_OUTPUT_PATH": layout.OUTPUT_DIR,
            "HOLOSCAN_WORKDIR": layout.WORK_DIR.rstrip("/"),
            "HOLOSCAN_MODEL_PATH": layout.MODELS_DIR.rstrip("/"),
            "HOLOSCAN_CONFIG_PATH": layout.CONFIG_PATH,
            "HOLOSCAN_APP_MANIFEST_PATH": layout.APP_MANIFEST_PATH,
            "HOLOSCAN_PKG_MANIFEST_PATH": layout.PKG_MANIFEST_PATH,
            "HOLOSCAN_DOCS_PATH": layout.DOCS_DIR,
            "HOLOSCAN_LOGS_PATH": layout.LOGS_DIR,
        },
        "input": {"path": layout.INPUT_DIR, "formats": config.input_formats},
        "liveness": None,
        "output": {"path": layout.OUTPUT_DIR, "formats": config.output_formats},
        "readiness": None,
        "sdk": SDK,
        "sdkVersion": sdk_version,
        "timeout": timeout,
        "version": config.version,
        "workingDirectory": layout.WORK_DIR.rstrip("/"),
    }


def package_manifest(config: AppConfig, models: dict[str, Path], platform: str = "x86_64") -> dict[str, Any]:
    model_root = layout.MODELS_DIR.rstrip("/")
    return {
        "apiVersion": layout.API_VERSION,
        "applicationRoot": layout.APP_DIR,
        "modelRoot": model_root,
        "models": {name: os.path.join(model_root, name) for name in models},
        "resources": config.resources,
        "version": config.version,
        "platformConfig": PLATFORMS[platform][1],
    }


def requested_gpus(pkg: dict[str, Any]) -> int:
    """As holoscan_cli/common/utils.py get_requested_gpus."""
    return int((pkg.get("resources") or {}).get("gpu", 0) or 0)
