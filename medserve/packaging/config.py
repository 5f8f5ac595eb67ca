"""Read and validate app.yaml, the packaging config holoscan-cli 4.2 reads (`monai-deploy package -c`).

The official reader (holoscan_cli/packager/config_reader.py) requires `application.title` and `resources`, takes
`application.version` unless --version is given, and reads the kebab-case keys `input-formats`,
`output-formats` and `pip-packages`. It silently ignores anything else, including the camelCase spellings the
SDK's own examples use; here those are errors, because a MAP whose manifest lost its formats still builds.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import InvalidRequirement, Requirement

from medserve.errors import PackagingError, first_line

logger = logging.getLogger("medserve.packaging.config")

APPLICATION_KEYS = {"title", "version", "input-formats", "output-formats", "pip-packages"}
# The runner and the MAP spec use camelCase inside `resources` (holoscan_cli/runner/resources.py reads
# `sharedMemory`), so there the kebab-case spelling is the mistake.
RESOURCE_KEYS = {
    "cpu", "cpuLimit", "gpu", "gpuLimit", "memory", "memoryLimit",
    "gpuMemory", "gpuMemoryLimit", "sharedMemory", "fragments",
}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Mi|MiB|Gi|GiB|MB|GB|m|g)\s*$")
_MEMORY_KEYS = {"memory", "memoryLimit", "gpuMemory", "gpuMemoryLimit", "sharedMemory"}
_SMALLEST_LIKELY_SHARED_MEMORY = 2**20  # less is most likely a unit left out


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


def _check_names(mapping: dict[Any, Any], path: Path, field: str, examples: str) -> None:
    """YAML reads `1:` or `true:` as a number or a boolean, where every key here is a name."""
    for key in mapping:
        if not isinstance(key, str):
            raise PackagingError(f"{path}: {field} key {key!r} is not a name; expected a name such as {examples}")


def _check_resources(resources: Any, path: Path) -> dict[str, Any]:
    if not isinstance(resources, dict):
        raise PackagingError(f"{path}: 'resources' must be a mapping (cpu, gpu, memory, gpuMemory, ...)")
    _check_resource_values(resources, path, "resources")
    fragments = resources.get("fragments")
    if fragments is not None:
        if not isinstance(fragments, dict) or not all(isinstance(f, dict) for f in fragments.values()):
            raise PackagingError(f"{path}: resources.fragments must map each fragment's name to its resources, got "
                                 f"{fragments!r}")
        _check_names(fragments, path, "resources.fragments", "a fragment's name (quoted if it is a number)")
        for name, fragment in fragments.items():  # the runner takes the largest sharedMemory of them all
            _check_resource_values(fragment, path, f"resources.fragments.{name}")
    # The /dev/shm size as `monai-deploy run` and `medserve run` will read it, the largest of the app's and its
    # fragments' (1 GiB when none names one): refused here when every run would refuse it.
    size = shared_memory_bytes({"resources": resources}, where=f"{path}: resources.sharedMemory (the largest of "
                                                                 "the app's and its fragments')")
    if size < _SMALLEST_LIKELY_SHARED_MEMORY:
        logger.warning("%s: resources.sharedMemory comes to %d bytes of /dev/shm (a bare number is bytes; e.g. 1Gi "
                       "is a GiB)", path, size)
    return dict(resources)


def _check_resource_values(resources: dict[Any, Any], path: Path, field: str) -> None:
    """The resources of the app or of one fragment: known camelCase keys, finite positive amounts (a NaN or an
    infinity would make pkg.json invalid JSON; a negative sharedMemory becomes an unlimited /dev/shm)."""
    _check_names(resources, path, field, "cpu, gpu or memory")
    for key, value in resources.items():
        camel = _kebab_to_camel(key.replace("_", "-"))
        if key in RESOURCE_KEYS:
            pass
        elif camel in RESOURCE_KEYS:
            spelling = "kebab-case" if "-" in key else "snake_case"
            raise PackagingError(f"{path}: {field}.{key} is {spelling}; the MAP runner reads {field}.{camel}")
        else:
            logger.warning("%s: unknown key %s.%s (kept in pkg.json, ignored by runners)", path, field, key)
            continue
        if key in {"cpu", "cpuLimit"} and not (_is_number(value) and _finite(value) and value > 0):
            raise PackagingError(f"{path}: {field}.{key} must be a positive number, got {value!r}")
        if key in {"gpu", "gpuLimit"} and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise PackagingError(f"{path}: {field}.{key} must be a whole number >= 0, got {value!r}")
        if key in _MEMORY_KEYS:
            _check_size(value, f"{path}: {field}.{key}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: int | float) -> bool:
    return isinstance(value, int) or math.isfinite(value)  # isfinite overflows on a 400-digit YAML integer


def _check_size(value: Any, where: str) -> None:
    matched = _MEMORY.match(value) if isinstance(value, str) else None
    amount = float(matched.group(1)) if matched else value if _is_number(value) else math.nan
    if not (_finite(amount) and amount > 0):
        raise PackagingError(f"{where} must be a size above zero like '2Gi', '512Mi', '1GB', got {value!r}")


def shared_memory_bytes(pkg: dict[str, Any], where: str = "pkg.json resources.sharedMemory") -> int:
    """/dev/shm size in bytes, read from pkg.json as `monai-deploy run --shm-size config` reads it: its units
    (Mi/MiB and Gi/GiB binary, MB/m and GB/g decimal), the largest of the app's and its fragments' values, and
    its default (1 GiB) when resources name none; docker and podman would read "m"/"g" as binary, and give
    64 MB without the flag."""
    from holoscan_cli.common.exceptions import InvalidSharedMemoryValueError
    from holoscan_cli.runner.resources import get_shared_memory_size

    resources = pkg.get("resources")
    if isinstance(resources, dict):  # holoscan-cli expects a mapping of fragments, not null
        pkg = {**pkg, "resources": {**resources, "fragments": resources.get("fragments") or {}}}
    try:
        size = int(get_shared_memory_size(pkg, False, False, None, "config"))
    except (InvalidSharedMemoryValueError, TypeError, AttributeError, ValueError, OverflowError) as error:
        reason = str(error).strip().rstrip(".")  # holoscan-cli's own messages end with ". "
        raise PackagingError(f"{where}: {reason}. Expected a size such as 1Gi, 512Mi or 2GB") from error
    if size <= 0:  # --shm-size 0 is no limit at all under podman
        raise PackagingError(f"{where}: comes to {size} bytes. Expected a size such as 1Gi, 512Mi or 2GB, above "
                             "zero")
    return size


def _written_text(text: str, keys: tuple[str, ...], loaded: Any) -> str:
    """A scalar as the file spells it (YAML's loader turns `010` into 8), found by its keys; as loaded where the
    file does not spell it under those keys (a merge key, `<<: *defaults`, brought it in)."""
    node = yaml.compose(text)
    for key in keys:
        node = next((value for name, value in getattr(node, "value", ()) if getattr(name, "value", None) == key),
                    None)
    return node.value if isinstance(node, yaml.ScalarNode) else str(loaded)


def _requirements(value: Any, path: Path) -> list[str] | None:
    """application.pip-packages, each a requirement pip can read (else pip fails inside the build, pointing at a
    requirements file of the image); options (--index-url), paths and URLs are left to pip."""
    packages = _string_list(value, f"{path}: application.pip-packages")
    for number, line in enumerate(packages or [], start=1):
        requirement = re.split(r"\s#|\s--", line, maxsplit=1)[0].strip()  # a comment, --hash options
        if not requirement or requirement.startswith(("-", "#")) or "/" in line or line.endswith((".whl", ".tar.gz")):
            continue
        try:
            Requirement(requirement)
        except InvalidRequirement as error:
            raise PackagingError(f"{path}: application.pip-packages item {number}, {line!r}, is not a requirement "
                                 f"pip can read ({first_line(error)}); expected e.g. 'nibabel==5.3.2'") from error
    return packages


def _yaml_problem(error: yaml.YAMLError) -> str:
    """The parser's problem and where, on one line (its own text quotes the line with a caret under it)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def read_app_config(path: Path, version_override: str | None = None) -> AppConfig:
    """Parse and validate app.yaml; every error names the file and the field."""
    path = Path(path)
    text, data = _read_yaml(path)
    application = data["application"]
    _check_application_keys(application, path)
    return AppConfig(
        path=path,
        title=_title(application, path),
        version=_version(application, text, path, version_override),
        input_formats=_string_list(application.get("input-formats"), f"{path}: application.input-formats"),
        output_formats=_string_list(application.get("output-formats"), f"{path}: application.output-formats"),
        pip_packages=_requirements(application.get("pip-packages"), path),
        resources=_check_resources(data["resources"], path),
        raw=data,
    )


def _read_yaml(path: Path) -> tuple[str, dict[str, Any]]:
    """The file's text and its mapping, which has an `application` mapping and a `resources` section."""
    if path.is_dir():
        raise PackagingError(f"application config {path} is a folder; expected the app.yaml file")
    if not path.is_file():
        raise PackagingError(f"application config not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise PackagingError(f"{path}: not valid YAML: {_yaml_problem(error)}") from error
    except (UnicodeDecodeError, OSError) as error:
        raise PackagingError(f"{path}: cannot be read as text ({error}); expected a UTF-8 YAML file") from error
    if not isinstance(data, dict):
        raise PackagingError(f"{path}: expected a mapping with 'application' and 'resources'")
    application = data.get("application")
    if application is None:
        raise PackagingError(f"{path}: required section 'application' is missing")
    if not isinstance(application, dict):
        raise PackagingError(f"{path}: 'application' must be a mapping (title, version, input-formats, ...), got "
                             f"{application!r}")
    if "resources" not in data:
        raise PackagingError(f"{path}: required section 'resources' is missing")
    for key in APPLICATION_KEYS.intersection(data):  # other top-level sections may configure the app's operators
        logger.warning("%s: %s at the top level is ignored by the packager; it belongs under application", path, key)
    return text, data


def _check_application_keys(application: dict[str, Any], path: Path) -> None:
    """Keys holoscan-cli 4.2 reads (kebab-case); the same keys spelt otherwise would be ignored without a word."""
    _check_names(application, path, "application", "title, version or input-formats")
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


def _title(application: dict[str, Any], path: Path) -> str:
    title = application.get("title")
    if not isinstance(title, str) or not title.strip():
        raise PackagingError(f"{path}: required field application.title is missing or empty")
    if not title.isprintable():  # it becomes an image label and a line of `medserve inspect`
        raise PackagingError(f"{path}: application.title {title!r} must be one line of printable text")
    return title


def _version(application: dict[str, Any], text: str, path: Path, version_override: str | None) -> str:
    """application.version as written (YAML reads 1.10 as 1.1), or --version."""
    version = application.get("version")
    if isinstance(version, (list, dict)) and not version_override:
        raise PackagingError(f"{path}: application.version must be a string, got {version!r}")
    if version is not None and not isinstance(version, str) and not version_override:
        written = _written_text(text, ("application", "version"), version)
        raise PackagingError(f"{path}: application.version {written} was read by YAML as {version!r}, not as the "
                             f"text written (010 is octal, 1.10 is 1.1); quote it: version: \"{written}\"")
    version = version_override or version
    if not version:
        raise PackagingError(f"{path}: required field application.version is missing (or pass --version)")
    if not version.isprintable() or not version.strip() or any(character.isspace() for character in version):
        # It becomes app.json's version and an image label (JSON-escaped there), read by tools as one word.
        where = "--version" if version_override else f"{path}: application.version"
        raise PackagingError(f"{where} {version!r} must be one word of printable text, like 1.0.2")
    return version
