"""Assemble the build context: app, libraries, models, manifests, tools script, pip inputs, Containerfile."""

from __future__ import annotations

import ast
import contextlib
import errno
import fnmatch
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import medserve
from medserve.errors import PackagingError
from medserve.packaging import layout
from medserve.packaging.config import AppConfig
from medserve.packaging.containerfile import TORCH_CPU_INDEX, PipIndexes, pip_config, render
from medserve.packaging.manifest import AppSource, named, sdk_pins

logger = logging.getLogger("medserve.packaging.context")

# Where a CA bundle for pip may be named, in the order pip's own settings win.
CA_BUNDLE_VARIABLES = ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")
# Holoscan (holoscan-cu13) loads libcudart.so.13 even on CPU; a clean image has no CUDA runtime.
CUDA_RUNTIME_PIN = "nvidia-cuda-runtime==13.0.*"
# copytree gathers its failures as text: ENOSPC and EDQUOT there are the context's disk, not the file copied.
_FULL_DISK = re.compile(rf"\[Errno ({errno.ENOSPC}|{errno.EDQUOT})\]")


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
    torch_index: str = TORCH_CPU_INDEX


def app_requirements(app: AppSource, config: AppConfig) -> list[str]:
    """requirements.txt of the app dir plus app.yaml's pip-packages, as the official packager merges them, plus
    exact pins of the MONAI Deploy App SDK and Holoscan versions the labels and app.json record (the official
    Dockerfile always installs `monai-deploy-app-sdk=={version}`)."""
    lines: list[str] = []
    path = app.directory / "requirements.txt"
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as error:
            raise PackagingError(f"{path}: cannot be read as text ({error}); expected a UTF-8 requirements "
                                 "file") from error
        lines += [line.strip() for line in re.sub(r"\\\r?\n", " ", text).splitlines()]  # joins `\` continuations
    lines += config.pip_packages or []
    lines = [line for line in lines if line and not line.startswith("#")]
    added: list[str] = []
    for pin in sdk_pins(lines):
        if pin.version is None:
            raise PackagingError(
                f"{pin.name} is not pinned (==) in {path} or in {config.path} application.pip-packages, and not "
                f"installed here to take its version from: add {pin.name}==VERSION"
            )
        if not pin.pinned:  # an unpinned line the app has stays, and pip resolves both together
            added.append(f"{pin.name}=={pin.version}")
    if named(lines, ("nvidia-cuda-runtime",)) is None:
        added.append(CUDA_RUNTIME_PIN)
    if added and any("--hash" in line for line in lines):
        # pip's hash-checking mode wants a hash on every line: ours would fail the build's pip step.
        raise PackagingError(f"{path} uses pip's hash-checking mode (--hash), so the build cannot add its own "
                             f"pins: add {', '.join(added)} to it, with their hashes")
    return lines + added


@functools.cache
def _dockerignore() -> tuple[tuple[str, bool], ...]:
    """(pattern, directories only) from holoscan-cli's templates/dockerignore, which the official packager puts
    next to its Dockerfile. Every pattern there is `**/NAME`: NAME matched at any depth."""
    try:
        text = resources.files("holoscan_cli.packager").joinpath("templates/dockerignore").read_text()
    except (ModuleNotFoundError, FileNotFoundError) as error:
        raise PackagingError("holoscan-cli==4.2.0 is needed for its dockerignore (pip install it)") from error
    patterns = (line.strip() for line in text.splitlines())
    return tuple((pattern.removeprefix("**/").rstrip("/"), pattern.endswith("/"))
                 for pattern in patterns if pattern and not pattern.startswith("#"))


def ignored(directory: str, names: list[str]) -> set[str]:
    """shutil.copytree's `ignore`: the entries of `directory` the official .dockerignore keeps out of an image."""
    return {name for name in names for pattern, directories_only in _dockerignore()
            if fnmatch.fnmatchcase(name, pattern)
            and (not directories_only or os.path.isdir(os.path.join(directory, name)))}


def no_room(context: Path) -> PackagingError:
    return PackagingError(f"no room left on the disk of the build context {context}: free space there, or set "
                          "TMPDIR to a folder on a disk with room for the app, its bundles and the wheels")


def _copy_tree(source: Path, target: Path, what: str) -> None:
    """copytree with the official ignore patterns; an unreadable entry (a dangling symlink) or a symlink loop is
    a PackagingError, as is a full disk (the context's, not the source's)."""
    try:
        shutil.copytree(source, target, ignore=ignored)
    except shutil.Error as error:
        if any(_FULL_DISK.search(str(reason)) for _, _, reason in error.args[0]):
            raise no_room(target.parent) from error
        bad, _, reason = error.args[0][0]
        loop = _loop_link(source, Path(bad))
        if loop is not None:
            raise PackagingError(f"{what} {source}: {loop} is a symlink back up the tree it is in (a loop); "
                                 "expected a tree of files (remove the link)") from error
        if os.path.islink(bad) and not os.path.exists(bad):
            reason = f"a symlink to {os.readlink(bad)}, which does not exist"
        raise PackagingError(f"{what} {source}: cannot copy {bad}: {reason}; expected readable files "
                             "(remove or fix it)") from error
    except RecursionError as error:
        raise PackagingError(f"{what} {source}: a symlink in it leads back up the tree it is in (a loop); "
                             "expected a tree of files (remove the link)") from error


def _loop_link(source: Path, bad: Path) -> Path | None:
    """The first symlink on the way from `source` to `bad` that points to a folder holding it (copytree follows
    it until the path is too long)."""
    try:
        parts = bad.relative_to(source).parts
    except ValueError:
        return None
    path = source
    for part in parts:
        path = path / part
        if path.is_symlink() and Path(os.path.realpath(path.parent)).is_relative_to(os.path.realpath(path)):
            return path
    return None


def _readable_by_all(path: Path) -> None:
    """Add read (and, for folders, search) permission for everyone to `path` and everything under it."""
    if path.is_file():
        os.chmod(path, path.stat().st_mode | 0o444)
        return
    for folder, _, files in os.walk(path):
        os.chmod(folder, os.stat(folder).st_mode | 0o555)
        for name in files:
            file = os.path.join(folder, name)
            os.chmod(file, os.stat(file).st_mode | 0o444)


def host_ca_bundle() -> Path | None:
    """The CA bundle this machine's pip and Python trust (PIP_CERT, REQUESTS_CA_BUNDLE, SSL_CERT_FILE, then
    OpenSSL's default file); None when none is a non-empty file (pip then uses its own certifi bundle)."""
    candidates = [os.environ.get(name) for name in CA_BUNDLE_VARIABLES]
    candidates.append(ssl.get_default_verify_paths().cafile)
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.path.getsize(candidate) > 0:
            return Path(candidate)
    return None


def check_torch_index(url: str, timeout: float = 10.0) -> None:
    """Refuse a build whose CPU torch index cannot be reached from here, in seconds: pip would retry it for
    minutes, then take torch from the other indexes (a CUDA build of several GB) and fail the CPU check."""
    if not url.startswith(("http://", "https://")):
        raise PackagingError(f"--torch-index {url}: expected an http(s) URL of a PyTorch wheel index")
    ca_bundle = host_ca_bundle()
    context = ssl.create_default_context(cafile=str(ca_bundle) if ca_bundle else None)
    remedy = ("pass --wheel-dir DIR with the wheels (`pip download -d DIR -r requirements.txt` on a machine that "
              "reaches it), or --torch-index URL of a mirror")
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout, context=context):
            return
    except urllib.error.HTTPError as error:
        if error.code == 404:
            raise PackagingError(f"the CPU variant installs torch from {url}, which has no torch project (404); "
                                 f"{remedy}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise PackagingError(f"the CPU variant installs torch from {url}, which this machine cannot reach "
                             f"({reason}); {remedy}") from None


def host_pip_indexes() -> PipIndexes:
    """index-url, extra-index-url and trusted-host as `pip install` here resolves them (PIP_* variables, then
    the [install], then the [global] section of pip's configuration files), read with `pip config list`.
    Only http(s) indexes are kept: file:// ones and find-links are folders of this machine, not of the build."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=False)
    settings: dict[tuple[str, str], str] = {}
    if listed.returncode != 0:  # no pip in this environment (a uv venv, say): the PIP_* variables still count
        logger.warning("cannot read pip's configuration (%s); the build uses only the PIP_* variables",
                       (listed.stderr.strip().splitlines() or ["pip config list failed"])[-1])
        for name in ("index-url", "extra-index-url", "trusted-host"):
            value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
            if value is not None:
                settings[(":env:", name)] = value
    for line in listed.stdout.splitlines():
        key, separator, quoted = line.partition("=")
        section, _, name = key.rpartition(".")
        if separator:
            with contextlib.suppress(ValueError, SyntaxError):
                settings[(section, name)] = str(ast.literal_eval(quoted))

    def values(name: str) -> list[str]:
        for section in (":env:", "install", "global"):
            if (section, name) in settings:
                return settings[(section, name)].split()
        return []

    def reachable(urls: list[str]) -> tuple[str, ...]:
        return tuple(url for url in urls if url.startswith(("http://", "https://")))

    index = reachable(values("index-url")[:1])
    return PipIndexes(index[0] if index else None, reachable(values("extra-index-url")), tuple(values("trusted-host")))


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


def deps_fingerprint(requirements: list[str], pip_conf: str, wheel_dir: Path | None, variant: str) -> str:
    """Goes into the pip RUN line so that the layer cache notices new pins, indexes or wheels; a hash only, as
    pip.conf may hold an index token."""
    digest = hashlib.sha256("\n".join(requirements).encode() + pip_conf.encode() + variant.encode())
    if wheel_dir is not None:
        for wheel in sorted(wheel_dir.iterdir()):
            digest.update(f"{wheel.name}:{wheel.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def write_context(inputs: BuildInputs, directory: Path) -> Path:
    """Write everything the Containerfile copies; returns the Containerfile path."""
    try:
        return _write_context(inputs, directory)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_room(directory) from error
        raise


def _write_context(inputs: BuildInputs, directory: Path) -> Path:
    _copy_tree(inputs.app.directory, directory / "app", "application directory")
    lib = directory / "lib"
    lib.mkdir()
    for package in _medserve_packages():
        _copy_tree(package, lib / package.name, "package")
    models = directory / "models"
    models.mkdir()
    for name, source in inputs.models.items():
        if source.is_file():
            (models / name).mkdir()
            shutil.copy2(source, models / name / source.name)
        else:
            _copy_tree(source, models / name, "model")
    if inputs.docs is not None:
        _copy_tree(inputs.docs, directory / "docs", "--docs")
    (directory / "map").mkdir()
    (directory / "map" / "app.json").write_text(json.dumps(inputs.app_json))
    (directory / "map" / "pkg.json").write_text(json.dumps(inputs.pkg_json))
    shutil.copy2(inputs.config.path, directory / "app.config")
    (directory / "tools").write_text(tools_script())
    (directory / "tools").chmod(0o755)
    # The image runs as another user (the holoscan user, or the host's UID with `medserve run`): what goes into
    # it is made readable by all, so that files and folders written under umask 077, or copied from a 0600
    # app.yaml, do not fail only at run time. (The official packager has the same gap.)
    for part in ("app", "lib", "models", "docs", "map", "app.config"):
        if (directory / part).exists():
            _readable_by_all(directory / part)

    # pip/ is bind-mounted into the pip step only: the CA bundle (networks that re-sign TLS), the wheels and
    # pip.conf (the index URL, which may carry a token) never become a layer, a RUN line or a label.
    pip_dir = directory / "pip"
    pip_dir.mkdir()
    requirements = app_requirements(inputs.app, inputs.config)
    (pip_dir / "requirements.txt").write_text("\n".join(requirements) + "\n")
    ca_bundle = host_ca_bundle()
    if ca_bundle is not None:
        shutil.copy2(ca_bundle, pip_dir / "ca.crt")
    if inputs.wheel_dir is not None:
        _link_tree(inputs.wheel_dir, pip_dir / "wheels")
    pip_conf = pip_config(inputs, host_pip_indexes(), ca_bundle is not None)
    (pip_dir / "pip.conf").write_text(pip_conf)

    containerfile = directory / "Containerfile"
    containerfile.write_text(
        render(inputs, has_docs=inputs.docs is not None,
               fingerprint=deps_fingerprint(requirements, pip_conf, inputs.wheel_dir, inputs.variant))
    )
    return containerfile
