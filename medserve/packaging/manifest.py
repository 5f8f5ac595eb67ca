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

from medserve.errors import PackagingError
from medserve.packaging import layout
from medserve.packaging.config import AppConfig

SDK = "monai-deploy"
PLATFORM_CONFIG = "dgpu"  # what the official packager records for --platform x86_64


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
    return (path / "configs").is_dir() and ((path / "models").is_dir() or (path / "configs" / "metadata.json").is_file())


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
        return {path.resolve().name: path}
    models: dict[str, Path] = {}
    for entry in sorted(os.listdir(path)):
        if (path / entry).is_file():
            models[path.resolve().stem] = path
        elif (path / entry).is_dir():
            models[entry] = path / entry
    if not models:
        raise PackagingError(f"models path {path} is an empty directory")
    return models


def _pinned_version(requirements: list[str], name: str) -> str | None:
    pattern = re.compile(rf"^\s*{re.escape(name)}\s*==\s*([^\s;#]+)", re.IGNORECASE)
    for line in requirements:
        match = pattern.match(line)
        if match:
            return match.group(1)
    return None


def sdk_versions(requirements: list[str]) -> tuple[str, str]:
    """(holoscan, monai-deploy-app-sdk) versions: the app's pins, else what this environment has installed."""

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "unknown"

    holoscan = _pinned_version(requirements, "holoscan-cu13") or _pinned_version(requirements, "holoscan")
    monai_deploy = _pinned_version(requirements, "monai-deploy-app-sdk")
    return holoscan or installed("holoscan-cu13"), monai_deploy or installed("monai-deploy-app-sdk")


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


def package_manifest(config: AppConfig, models: dict[str, Path]) -> dict[str, Any]:
    model_root = layout.MODELS_DIR.rstrip("/")
    return {
        "apiVersion": layout.API_VERSION,
        "applicationRoot": layout.APP_DIR,
        "modelRoot": model_root,
        "models": {name: os.path.join(model_root, name) for name in models},
        "resources": config.resources,
        "version": config.version,
        "platformConfig": PLATFORM_CONFIG,
    }


def requested_gpus(pkg: dict[str, Any]) -> int:
    """As holoscan_cli/common/utils.py get_requested_gpus."""
    return int((pkg.get("resources") or {}).get("gpu", 0) or 0)
