"""`medserve package`: validate the inputs, write the build context, build the MAP with buildah or docker."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from medserve.errors import PackagingError
from medserve.packaging import engine, layout
from medserve.packaging.config import read_app_config
from medserve.packaging.containerfile import TORCH_CPU_INDEX
from medserve.packaging.context import BuildInputs, app_requirements, check_torch_index, write_context
from medserve.packaging.manifest import (PLATFORMS, app_manifest, find_app, package_manifest, scan_models,
                                         sdk_versions)

logger = logging.getLogger("medserve.packaging.build")

_STEP = re.compile(r"^(?:STEP|Step) (\d+)/(\d+)")
_DOCKER_STEP = re.compile(r"^#\d+ \[(?:\S+ )?(\d+)/(\d+)\]")


@dataclass(frozen=True)
class PackageRequest:
    application: Path
    config: Path
    tag: str
    models: Path | None = None
    platform: str = "x86_64"
    base_image: str = layout.DEFAULT_BASE_IMAGE
    builder: str = "auto"
    wheel_dir: Path | None = None
    variant: str = "auto"  # auto: cuda when app.yaml asks for a GPU, else cpu
    version: str | None = None
    docs: Path | None = None
    no_cache: bool = False
    uid: int = 1000
    gid: int = 1000
    torch_index: str = TORCH_CPU_INDEX  # where the CPU variant's torch comes from, without --wheel-dir


@dataclass(frozen=True)
class BuildResult:
    tag: str
    image_id: str
    builder: str
    variant: str
    seconds: float


ProgressCallback = Callable[[int, int, str], None]


def prepare(request: PackageRequest) -> BuildInputs:
    """Everything that can be checked before a build starts; raises PackagingError naming the bad input."""
    app = find_app(request.application)
    config = read_app_config(request.config, request.version)
    models = scan_models(request.models) if request.models is not None else {}
    if request.platform not in PLATFORMS:
        raise PackagingError(f"--platform {request.platform}: expected one of {', '.join(PLATFORMS)}")
    if request.wheel_dir is not None and not any(Path(request.wheel_dir).glob("*.whl")):
        raise PackagingError(f"--wheel-dir {request.wheel_dir}: no .whl files there")
    if request.docs is not None and not Path(request.docs).is_dir():
        raise PackagingError(f"--docs {request.docs}: not a directory")
    for flag, value in (("--uid", request.uid), ("--gid", request.gid)):
        if not 1 <= value <= 65533:  # 0 is root's, which the user set-up cannot take over; 65534 is nobody's
            raise PackagingError(f"{flag} {value}: expected a number from 1 to 65533 for the image's holoscan user")
    if request.variant not in {"auto", "cpu", "cuda"}:
        raise PackagingError(f"--variant {request.variant}: expected auto, cpu or cuda")
    variant = request.variant if request.variant != "auto" else ("cuda" if config.gpus > 0 else "cpu")
    holoscan_version, sdk_version = sdk_versions(app_requirements(app, config))
    if not models:  # allowed, as the official packager allows it; an app that loads a bundle then always fails
        logger.warning("no -m: the MAP holds no model (/opt/holoscan/models is empty); give -m BUNDLE_DIR unless "
                       "the app needs none")
    return BuildInputs(
        app=app, config=config, models=models,
        app_json=app_manifest(config, app, sdk_version),
        pkg_json=package_manifest(config, models, request.platform),
        tag=request.tag, base_image=request.base_image, variant=variant,
        holoscan_version=holoscan_version, sdk_version=sdk_version,
        wheel_dir=Path(request.wheel_dir) if request.wheel_dir else None,
        docs=Path(request.docs) if request.docs else None, uid=request.uid, gid=request.gid,
        torch_index=request.torch_index,
    )


def _build_argv(builder: str, request: PackageRequest, containerfile: Path, context: Path) -> list[str]:
    platform = PLATFORMS[request.platform][0]
    if builder == "docker":
        argv = ["docker", "build", "--progress", "plain", "--platform", platform]
    else:
        # chroot isolation: the default (oci) and rootless modes fail on CI runners without user namespaces.
        argv = [*engine.base_command("buildah"), "bud", "--isolation", "chroot", "--layers", "--force-rm",
                "--platform", platform]
    if request.no_cache:
        argv.append("--no-cache")
    return [*argv, "-f", str(containerfile), "-t", request.tag, str(context)]


def _check_local_base_image(builder: str, image: str, platform: str) -> None:
    """A base image that lives only in the local store (`localhost/...`) must be there and be built for the
    platform: otherwise the builder goes looking for it on a registry called `localhost` and reports a refused
    connection."""
    if engine.registry_host(image) != "localhost":
        return  # a registry image (a short name too): the builder pulls it, for the platform asked
    argv = [*engine.base_command("buildah"), "inspect", "--type", "image", "--format", "{{.OCIv1.Architecture}}",
            image] if builder == "buildah" else ["docker", "image", "inspect", "--format", "{{.Architecture}}", image]
    found = subprocess.run(argv, capture_output=True, text=True)
    if found.returncode != 0:
        raise PackagingError(f"--base-image {image} is not in the local store; build it with `python -m "
                             "medserve.packaging.base`, or name a registry image")
    wanted = PLATFORMS[platform][0].split("/", 1)[1]
    if found.stdout.strip() != wanted:
        raise PackagingError(f"--base-image {image} is linux/{found.stdout.strip()}; --platform {platform} builds "
                             f"linux/{wanted}: give a base image for that architecture")


def _image_id(builder: str, tag: str) -> str:
    argv = [*engine.base_command("buildah"), "images", "--format", "{{.ID}}", "--noheading", tag] \
        if builder == "buildah" else ["docker", "image", "inspect", "--format", "{{.Id}}", tag]
    return engine.run(argv, f"looking up {tag}").stdout.split()[0]


def package(request: PackageRequest, progress: ProgressCallback | None = None) -> BuildResult:
    inputs = prepare(request)
    builder = engine.pick(request.builder, "buildah")
    _check_local_base_image(builder, inputs.base_image, request.platform)
    logger.info("building %s (%s variant) with %s from %s", request.tag, inputs.variant, builder,
                inputs.base_image)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="medserve-map-") as temp:
        context = Path(temp)
        containerfile = write_context(inputs, context)
        if inputs.variant == "cpu" and inputs.wheel_dir is None:  # the last check: the inputs' errors come first
            check_torch_index(inputs.torch_index)
        env = dict(os.environ, DOCKER_BUILDKIT="1")

        def on_line(line: str) -> None:
            logger.debug("%s: %s", builder, line)
            match = _STEP.match(line) or _DOCKER_STEP.match(line)
            if match and progress is not None:
                progress(int(match.group(1)), int(match.group(2)), line)

        engine.stream(_build_argv(builder, request, containerfile, context), f"building {request.tag}",
                      on_line, env=env)
    seconds = time.monotonic() - started
    result = BuildResult(request.tag, _image_id(builder, request.tag), builder, inputs.variant, seconds)
    logger.info("built %s (%s) in %.1f s", result.tag, result.image_id[:12], seconds)
    return result
