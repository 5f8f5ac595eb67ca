"""CLI: `medserve package | push | run | inspect` (flags as in issue 4 and `monai-deploy package|run`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from medserve.packaging import layout
from medserve.packaging.containerfile import TORCH_CPU_INDEX
from medserve.packaging.manifest import PLATFORMS
from medserve.stopping import terminable

logger = logging.getLogger("medserve.packaging.commands")


def _package(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from medserve.packaging.build import PackageRequest, package
    from medserve.packaging.registry import image_name, push, push_destination

    image_name(args.tag)  # before minutes of building, not after; so is the push destination
    if args.push is not None:
        push_destination(args.push)
    request = PackageRequest(
        application=args.application, config=args.config, tag=args.tag, models=args.models,
        platform=args.platform, base_image=args.base_image, builder=args.builder, wheel_dir=args.wheel_dir,
        variant=args.variant, version=args.version, docs=args.docs, no_cache=args.no_cache,
        uid=args.uid, gid=args.gid, torch_index=args.torch_index,
    )
    console = Console(stderr=True)
    # A MAP build is minutes of pip and layer commits: show which step it is in.
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(f"building {args.tag}", total=None)

        def progress(step: int, total: int, line: str) -> None:
            bar.update(task, completed=step, total=total, description=line[:70])
            if not console.is_terminal:
                logger.info("%s", line[:120])

        result = package(request, progress)
    print(f"built {result.tag} ({result.image_id[:12]}, {result.variant} variant, {result.builder}) "
          f"in {result.seconds:.1f} s")
    if args.push:
        digest = push(result.tag, args.push, args.builder)
        print(f"pushed {args.push}@{digest}")
    return 0


def _push(args: argparse.Namespace) -> int:
    from medserve.packaging.registry import push

    digest = push(args.image, args.destination, args.engine)
    print(f"pushed {args.destination}@{digest}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from medserve.packaging.run import RunRequest, run

    return run(RunRequest(image=args.image, input=args.input, output=args.output, gpus=args.gpus,
                          engine=args.engine, config=args.config, extra_args=args.args))


def _inspect(args: argparse.Namespace) -> int:
    from medserve.packaging.run import inspect

    json.dump(inspect(args.image, args.engine), sys.stdout, indent=2)
    print()
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("package", help="build a MONAI Application Package (MAP) image",
                              description="Build a MAP with buildah (no Docker engine needed) or docker.")
    p.add_argument("application", type=Path, help="app directory (with app.py) or the app.py file")
    p.add_argument("-c", "--config", type=Path, required=True, help="app.yaml (holoscan-cli 4.2 format)")
    p.add_argument("-t", "--tag", required=True, help="image name:tag")
    p.add_argument("-m", "--models", type=Path, help="model file, bundle directory or folder of models")
    p.add_argument("--platform", default="x86_64", choices=list(PLATFORMS),
                   help="as monai-deploy package: x86_64 (default), sbsa, igx-dgpu (dGPU); jetson, igx-igpu (iGPU)")
    p.add_argument("--base-image", default=layout.DEFAULT_BASE_IMAGE,
                   help="base image with bash, jq and python3.11 (default %(default)s, see "
                        "`python -m medserve.packaging.base`)")
    p.add_argument("--builder", choices=["auto", "buildah", "docker"], default="auto",
                   help="auto: docker when an engine answers, else buildah")
    p.add_argument("--wheel-dir", type=Path, help="install Python packages from these wheels only (offline)")
    p.add_argument("--variant", choices=["auto", "cpu", "cuda"], default="auto",
                   help="torch build: cpu or cuda; auto = cuda when app.yaml asks for a GPU")
    p.add_argument("--torch-index", default=TORCH_CPU_INDEX, metavar="URL",
                   help="PyTorch CPU wheel index of the cpu variant without --wheel-dir (default %(default)s); "
                        "checked to be reachable before the build")
    p.add_argument("--version", help="overrides application.version")
    p.add_argument("--docs", type=Path, help="documentation folder copied to /opt/holoscan/docs")
    p.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    p.add_argument("--uid", type=int, default=1000, help="UID of the image's holoscan user")
    p.add_argument("--gid", type=int, default=1000, help="GID of the image's holoscan user")
    p.add_argument("--push", metavar="REGISTRY/REPO:TAG", help="push the built image there")
    p.set_defaults(handler=terminable(_package))

    p = subparsers.add_parser("push", help="push a MAP image to an OCI registry",
                              description="Credentials: MEDSERVE_REGISTRY_USER/_PASSWORD, or GHCR_USER/GHCR_TOKEN "
                                          "for ghcr.io; never written to disk.")
    p.add_argument("image")
    p.add_argument("destination", metavar="REGISTRY/REPO:TAG")
    p.add_argument("--engine", choices=["auto", "buildah", "docker"], default="auto")
    p.set_defaults(handler=terminable(_push))

    p = subparsers.add_parser("run", help="run a MAP on an input folder, as `monai-deploy run` does",
                              usage="%(prog)s [-h] [-i INPUT] [-o OUTPUT] [--gpus GPUS] [--config CONFIG] "
                                    "[--engine {auto,podman,docker}] image [-- ARG ...]")
    p.add_argument("image")
    p.add_argument("-i", "--input", type=Path, help="input folder, mounted at the manifest's input path")
    p.add_argument("-o", "--output", type=Path, help="output folder (created if missing)")
    p.add_argument("--gpus", help="'all', a number of GPUs (0: none), or device indices ('0,2', 'device=1'); "
                   "default: what pkg.json asks for, if the host has GPUs")
    p.add_argument("--config", type=Path, help="replace the packaged app.yaml")
    p.add_argument("--engine", choices=["auto", "podman", "docker"], default="auto")
    # nargs="+" made optional, not "*": argparse would take an empty "*" right after IMAGE and then refuse
    # the arguments after `--` (`medserve run IMAGE -i IN -o OUT -- ARGS`).
    app_args = p.add_argument("args", nargs="+", default=[], metavar="ARG",
                              help="arguments passed to the app, after --")
    app_args.required = False
    p.set_defaults(handler=_run)

    p = subparsers.add_parser("inspect", help="print a MAP's manifests and labels as JSON")
    p.add_argument("image")
    p.add_argument("--engine", choices=["auto", "podman", "docker"], default="auto")
    p.set_defaults(handler=terminable(_inspect))
