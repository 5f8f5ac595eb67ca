"""Read and validate app.yaml, the packaging config holoscan-cli 4.2 reads (`monai-deploy package -c`).

The official reader (holoscan_cli/packager/config_reader.py) requires `application.title` and `resources`, takes
`application.version` unless --version is given, and reads the kebab-case keys `input-formats`,
`output-formats` and `pip-packages`. It silently ignores anything else, including the camelCase spellings the
SDK's own examples use; here those are errors, because a MAP whose manifest lost its formats still builds.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from medserve.errors import PackagingError

logger = logging.getLogger("medserve.packaging.config")

APPLICATION_KEYS = {"title", "version", "input-formats", "output-formats", "pip-packages"}
# The runner and the MAP spec use camelCase inside `resources` (holoscan_cli/runner/resources.py reads
# `sharedMemory`), so there the kebab-case spelling is the mistake.
RESOURCE_KEYS = {
    "cpu", "cpuLimit", "gpu", "gpuLimit", "memory", "memoryLimit",
    "gpuMemory", "gpuMemoryLimit", "sharedMemory", "fragments",
}
_MEMORY = re.compile(r"^\s*\d+(\.\d+)?\s*(Mi|MiB|Gi|GiB|MB|GB|m|g)\s*$")
_MEMORY_KEYS = {"memory", "memoryLimit", "gpuMemory", "gpuMemoryLimit", "sharedMemory"}


def _camel_to_kebab(key: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", lambda m: "-" + m.group(1).lower(), key)


def _kebab_to_camel(key: str) -> str:
    head, *rest = key.split("-")
    return head + "".join(part.capitalize() for part in rest)


@dataclass(frozen=True)
class AppConfig:
    """The parts of app.yaml that end up in the manifests and the image."""

    path: Path
    title: str
    version: str | None
    input_formats: list[str] | None
    output_formats: list[str] | None
    pip_packages: list[str] | None
    resources: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def gpus(self) -> int:
        return int(self.resources.get("gpu", 0) or 0)


def _string_list(value: Any, where: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PackagingError(f"{where} must be a list of strings, got {value!r}")
    return list(value)


def _check_resources(resources: Any, path: Path) -> dict[str, Any]:
    if not isinstance(resources, dict):
        raise PackagingError(f"{path}: 'resources' must be a mapping (cpu, gpu, memory, gpuMemory, ...)")
    for key, value in resources.items():
        camel = _kebab_to_camel(key.replace("_", "-"))
        if key in RESOURCE_KEYS:
            pass
        elif camel in RESOURCE_KEYS:
            spelling = "kebab-case" if "-" in key else "snake_case"
            raise PackagingError(f"{path}: resources.{key} is {spelling}; the MAP runner reads resources.{camel}")
        else:
            logger.warning("%s: unknown key resources.%s (kept in pkg.json, ignored by runners)", path, key)
            continue
        if key in {"cpu", "cpuLimit"} and not (isinstance(value, (int, float)) and value > 0):
            raise PackagingError(f"{path}: resources.{key} must be a positive number, got {value!r}")
        if key in {"gpu", "gpuLimit"} and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise PackagingError(f"{path}: resources.{key} must be a whole number >= 0, got {value!r}")
        if key in _MEMORY_KEYS:
            _check_size(value, f"{path}: resources.{key}")
        if key == "fragments":
            _check_fragments(value, path)
    return dict(resources)


def _check_size(value: Any, where: str) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            or (isinstance(value, str) and _MEMORY.match(value))):
        raise PackagingError(f"{where} must be a size like '2Gi', '512Mi', '1GB', got {value!r}")


def _check_fragments(fragments: Any, path: Path) -> None:
    """`resources.fragments`: per fragment of a distributed app, its own resources; the runner takes the largest
    sharedMemory of them all."""
    if fragments is None:
        return
    if not isinstance(fragments, dict) or not all(isinstance(f, dict) for f in fragments.values()):
        raise PackagingError(f"{path}: resources.fragments must map each fragment's name to its resources, got "
                             f"{fragments!r}")
    for name, resources in fragments.items():
        for key, value in resources.items():
            if key in _MEMORY_KEYS:
                _check_size(value, f"{path}: resources.fragments.{name}.{key}")


def _yaml_problem(error: yaml.YAMLError) -> str:
    """The parser's problem and where, on one line (its own text quotes the line with a caret under it)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def read_app_config(path: Path, version_override: str | None = None) -> AppConfig:
    """Parse and validate app.yaml; every error names the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise PackagingError(f"application config not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise PackagingError(f"{path}: not valid YAML: {_yaml_problem(error)}") from error
    except (UnicodeDecodeError, OSError) as error:
        raise PackagingError(f"{path}: cannot be read as text ({error}); expected a UTF-8 YAML file") from error
    if not isinstance(data, dict):
        raise PackagingError(f"{path}: expected a mapping with 'application' and 'resources'")
    application = data.get("application")
    if not isinstance(application, dict):
        raise PackagingError(f"{path}: required section 'application' is missing")
    if "resources" not in data:
        raise PackagingError(f"{path}: required section 'resources' is missing")

    for key in application:
        if key in APPLICATION_KEYS:
            continue
        kebab = _camel_to_kebab(key).replace("_", "-")
        if kebab in APPLICATION_KEYS:
            spelling = "snake_case" if "_" in key else "camelCase"
            raise PackagingError(
                f"{path}: application.{key} is {spelling}; holoscan-cli 4.2 reads application.{kebab} "
                "and would silently ignore it"
            )
        logger.warning("%s: unknown key application.%s is ignored by the packager", path, key)

    title = application.get("title")
    if not isinstance(title, str) or not title.strip():
        raise PackagingError(f"{path}: required field application.title is missing or empty")
    version = application.get("version")
    if version is not None and not isinstance(version, (str, int, float)):
        raise PackagingError(f"{path}: application.version must be a string, got {version!r}")
    if isinstance(version, float) and not version_override:
        raise PackagingError(
            f"{path}: application.version {version!r} was read by YAML as a number (1.10 becomes 1.1); "
            f"quote it, e.g. version: \"{version}\""
        )
    version = version_override or (str(version) if version is not None else None)
    if not version:
        raise PackagingError(f"{path}: required field application.version is missing (or pass --version)")

    return AppConfig(
        path=path,
        title=title,
        version=version,
        input_formats=_string_list(application.get("input-formats"), f"{path}: application.input-formats"),
        output_formats=_string_list(application.get("output-formats"), f"{path}: application.output-formats"),
        pip_packages=_string_list(application.get("pip-packages"), f"{path}: application.pip-packages"),
        resources=_check_resources(data["resources"], path),
        raw=data,
    )
