"""`medserve run` and `medserve inspect`: read a MAP's manifests from the image and run it as
`monai-deploy run` would (holoscan_cli/common/dockerutils.py docker_run), with podman or docker."""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from medserve.errors import PackagingError
from medserve.packaging import engine, layout, registry
from medserve.packaging.config import shared_memory_bytes
from medserve.packaging.manifest import requested_gpus
from medserve.stopping import termination_as_interrupt

logger = logging.getLogger("medserve.packaging.run")

# What `monai-deploy run` asks for (holoscan_cli/common/dockerutils.py docker_run): locked memory unlimited and
# a 64 MB stack (Holoscan warns, and deep graphs fail, below 32 MB).
OFFICIAL_ULIMITS = {"memlock": -1, "stack": 67108864}
_RLIMITS = {"memlock": resource.RLIMIT_MEMLOCK, "stack": resource.RLIMIT_STACK,
            "nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC}
_CAP_SYS_RESOURCE = 24


def _can_raise_limits() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE: without it (CI sandboxes, some VMs) runc cannot give a
    container any limit above this process's own."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    return False


def _pid_max() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text())


def ulimits(tool: str) -> list[str]:
    """`--ulimit` values: the official ones where the engine can grant them (docker's daemon, podman with
    CAP_SYS_RESOURCE). Without CAP_SYS_RESOURCE, rootful podman's own nofile/nproc defaults (2^20) and the
    official values fail in runc, so each limit is at most this process's own (nproc also at most
    kernel.pid_max, above which it means nothing and runc refuses it)."""
    if tool == "docker" or _can_raise_limits():
        return [f"{name}={value}" for name, value in OFFICIAL_ULIMITS.items()]
    unlimited = resource.RLIM_INFINITY  # -1, as --ulimit writes it
    limits = []
    for name, wanted in OFFICIAL_ULIMITS.items():
        hard = resource.getrlimit(_RLIMITS[name])[1]
        value = hard if hard != unlimited and (wanted == unlimited or wanted > hard) else wanted
        limits.append(f"{name}={value}:{value}")
    for name in ("nofile", "nproc"):
        soft, hard = resource.getrlimit(_RLIMITS[name])
        if name == "nproc":
            soft, hard = (_pid_max() if value == unlimited else min(value, _pid_max()) for value in (soft, hard))
        limits.append(f"{name}={soft}:{hard}")
    return limits


def _tool_argv(tool: str, verb: str) -> list[str]:
    # runc: crun/default runtimes fail to set up cgroups in some CI sandboxes; runc works everywhere we tried.
    runtime = ["--runtime", "runc"] if tool == "podman" and shutil.which("runc") else []
    return [*engine.base_command(tool), *runtime, verb]


def _image_present(image: str, tool: str) -> bool:
    argv = [*engine.base_command(tool), "image", "exists", image] if tool == "podman" \
        else ["docker", "image", "inspect", image]
    return subprocess.run(argv, capture_output=True).returncode == 0


def ensure_image(image: str, tool: str) -> None:
    """Pull a registry image that is not here yet with the registry credentials (medserve push's: in-memory
    auth file), so that create/run never pull on their own, without them. `localhost/NAME` names a local image
    (podman's name for what `medserve package` built): one that is missing is refused, where the engine would
    try a registry at https://localhost and report that. A bare name has no registry to log in to: the engine
    resolves it."""
    host = engine.registry_host(image)
    if host is None or _image_present(image, tool):
        return
    if host == "localhost":
        raise PackagingError(f"{image} is not in {tool}'s local image store; build it with `medserve package`, "
                             f"or name a registry image")
    registry.pull(image, tool)


def read_manifests(image: str, tool: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """app.json and pkg.json, copied out of a created (never started) container, as the official runner does."""
    ensure_image(image, tool)
    # Named before it exists: an interruption while the engine creates it still finds it to remove.
    container = f"medserve-manifest-{uuid.uuid4().hex[:12]}"
    try:
        engine.run([*_tool_argv(tool, "create"), "--name", container, image], f"reading manifests of {image}",
                   timeout=600)
        with tempfile.TemporaryDirectory(prefix="medserve-manifest-") as temp:
            manifests = []
            for path in (layout.APP_MANIFEST_PATH, layout.PKG_MANIFEST_PATH):
                target = Path(temp) / posixpath.basename(path)
                engine.run([*engine.base_command(tool), "cp", f"{container}:{path}", str(target)],
                           f"{image} is not a MAP: copying {path}")
                try:
                    manifests.append(json.loads(target.read_text()))
                except json.JSONDecodeError as error:
                    raise PackagingError(f"{image}: {path} is not valid JSON: {error}") from error
    finally:
        _remove_until_gone(tool, container)
    return manifests[0], manifests[1]


def _remove_until_gone(tool: str, container: str, patience: float = 15.0) -> None:
    """Remove a container, again every half second while the engine refuses: a `cp` killed by an interruption
    can leave it locked for a moment (podman then shows it as "Removing" for good)."""
    deadline = time.monotonic() + patience
    while True:
        removed = subprocess.run([*engine.base_command(tool), "rm", "-f", container], capture_output=True, text=True)
        if removed.returncode == 0 or "no such container" in removed.stderr.lower():  # docker's for one gone
            return
        if time.monotonic() > deadline:
            logger.warning("could not remove container %s: %s", container,
                           (removed.stderr.strip().splitlines() or ["no reason given"])[-1])
            return
        time.sleep(0.5)


def image_config(image: str, tool: str) -> dict[str, Any]:
    out = engine.run([*engine.base_command(tool), "image", "inspect", image], f"inspecting {image}").stdout
    return json.loads(out)[0]


def inspect(image: str, engine_choice: str = "auto") -> dict[str, Any]:
    registry.image_reference(image)
    tool = engine.pick(engine_choice, "podman")
    app, pkg = read_manifests(image, tool)
    config = image_config(image, tool)
    labels = config.get("Labels") or config.get("Config", {}).get("Labels") or {}
    return {"image": image, "id": config.get("Id"), "size": config.get("Size"), "labels": labels,
            "app.json": app, "pkg.json": pkg}


def host_gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return len(result.stdout.splitlines()) if result.returncode == 0 else 0


@dataclass
class RunRequest:
    image: str
    input: Path | None
    output: Path | None
    gpus: str | None = None  # "all", a count, device indices ("0,2"), or None: what pkg.json asks for
    engine: str = "auto"
    config: Path | None = None  # replaces the packaged app.yaml
    extra_args: list[str] = field(default_factory=list)
    # The container's name: an interrupted `run` removes the container by it (the engine would leave it running).
    name: str = field(default_factory=lambda: f"medserve-run-{uuid.uuid4().hex[:12]}")


def _mapped(path: str, working_dir: str) -> str:
    return path if posixpath.isabs(path) else posixpath.join(working_dir, path)


def wanted_gpus(value: str | None) -> int | str | tuple[int, ...] | None:
    """--gpus: None (what pkg.json asks for), "all", a number of GPUs (the first ones, as docker's `--gpus N`; 0
    runs on the CPU on a GPU host), or a device list: "0,2" or "device=1" (the indices, as docker's
    `--gpus device=...`)."""
    if value is None or value == "all":
        return value
    if value.isascii() and value.isdigit():
        return int(value)
    listed = value.removeprefix("device=")
    indices = listed.split(",")
    if ("," in listed or listed != value) and all(i.isascii() and i.isdigit() for i in indices):
        if len(set(indices)) != len(indices):
            raise PackagingError(f"--gpus {value}: a device is listed twice")
        return tuple(int(i) for i in indices)
    raise PackagingError(f"--gpus {value}: expected 'all', a number of GPUs (0, 1, 2, ...) or device indices "
                         "('0,2' or 'device=1')")


def _gpu_args(tool: str, pkg: dict[str, Any], wanted: int | str | tuple[int, ...] | None) -> list[str]:
    asked = requested_gpus(pkg)
    if wanted == 0 or (wanted is None and asked == 0):
        return []
    available = host_gpu_count()
    if available == 0:
        if wanted is None:
            logger.warning("the package asks for %s GPU(s) and this host has none: running on CPU", asked)
        else:
            shown = ",".join(map(str, wanted)) if isinstance(wanted, tuple) else wanted
            logger.warning("--gpus %s asks for GPUs and this host has none: running on CPU", shown)
        return []
    if isinstance(wanted, tuple):
        missing = [i for i in wanted if i >= available]
        if missing:
            raise PackagingError(f"GPU device(s) {', '.join(map(str, missing))} requested; this host has "
                                 f"{available} (devices 0-{available - 1})")
        devices = list(wanted)
    else:
        count = available if wanted == "all" else int(wanted or asked)
        if count > available:
            raise PackagingError(f"{count} GPU(s) requested, this host has {available}")
        devices = list(range(count))
    if tool == "docker":
        listed = ",".join(map(str, devices))
        return ["--gpus", "all" if wanted == "all" else f'"device={listed}"']
    # podman: CDI devices (nvidia-ctk cdi generate writes /etc/cdi/nvidia.yaml)
    return [arg for i in devices for arg in ("--device", f"nvidia.com/gpu={i}")]


def run_argv(request: RunRequest, tool: str, app: dict[str, Any], pkg: dict[str, Any]) -> list[str]:
    working_dir = app.get("workingDirectory") or layout.WORK_DIR
    mapped_input = _mapped((app.get("input") or {}).get("path", layout.INPUT_DIR), working_dir)
    mapped_output = _mapped((app.get("output") or {}).get("path", layout.OUTPUT_DIR), working_dir)
    environment = {"HOLOSCAN_HOSTING_SERVICE": "HOLOSCAN_RUN", "NVIDIA_DRIVER_CAPABILITIES": "all",
                   "UCX_CM_USE_ALL_DEVICES": "n"}
    for name, value in (app.get("environment") or {}).items():
        environment[name] = {"HOLOSCAN_INPUT_PATH": mapped_input,
                             "HOLOSCAN_OUTPUT_PATH": mapped_output}.get(name, value)
    argv = _tool_argv(tool, "run")
    # --network none: a MAP reads and writes mounted folders only; podman's default network also needs
    # bridge and firewall setup that CI sandboxes refuse.
    argv += ["--rm", "--name", request.name, "--network", "none", "--user", f"{os.getuid()}:{os.getgid()}",
             "-w", working_dir]
    for limit in ulimits(tool):
        argv += ["--ulimit", limit]
    argv += ["--shm-size", str(shared_memory_bytes(pkg))]
    if request.input is not None:
        argv += ["-v", f"{request.input.resolve()}:{mapped_input}:ro"]
    if request.output is not None:
        argv += ["-v", f"{request.output.resolve()}:{mapped_output}"]
    if request.config is not None:
        argv += ["-v", f"{request.config.resolve()}:{environment.get('HOLOSCAN_CONFIG_PATH', layout.CONFIG_PATH)}:ro"]
    for name, value in sorted(environment.items()):
        argv += ["-e", f"{name}={value}"]
    argv += _gpu_args(tool, pkg, wanted_gpus(request.gpus))
    return [*argv, request.image, *request.extra_args]


def _check_output(path: Path) -> None:
    """-o must be a folder or creatable as one: nothing on its way may be a file."""
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise PackagingError(f"output folder {path}: {blocker} is a file; expected a folder (or a path to create one)")


def _make_output(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise PackagingError(f"output folder {path} cannot be created: {error.strerror}") from error


def _check_links_stay_inside(folder: Path, shown: int = 3) -> None:
    """Only the -i folder is mounted: a symbolic link in it that names an absolute path, or leaves the folder,
    dangles in the container, where the app would skip its file as a broken link and segment what is left."""
    root = os.path.realpath(folder)
    broken: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):  # linked folders are listed, not entered
        dirnames.sort()  # named in a stable order, folder by folder
        for name in sorted((*dirnames, *filenames)):
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                continue
            target = os.readlink(path)
            # In the container the folder has another parent: a target that steps out of it (even to come back,
            # "../study/a.dcm") dangles there; realpath also catches a chain through another link that leaves.
            within = os.path.normpath(os.path.join(os.path.relpath(dirpath, folder), target))
            if (os.path.isabs(target) or within == ".." or within.startswith(".." + os.sep)
                    or os.path.commonpath([root, os.path.realpath(path)]) != root):
                broken.append(f"{path} -> {target}")
    if broken:
        more = f" and {len(broken) - shown} more" if len(broken) > shown else ""
        raise PackagingError(f"input folder {folder}: {len(broken)} symbolic link(s) name an absolute path or one "
                             f"outside it ({'; '.join(broken[:shown])}{more}); the container sees only this folder, "
                             "where they would be broken. Copy the study with its links followed (cp -rL), or "
                             "make the links relative, within the folder")


def prepare(request: RunRequest) -> list[str]:
    """Check the request, read the image's manifests and return the engine command line that runs it; the
    model server runs that itself to capture the container's log. The output folder is created only once the
    image is known to be a MAP."""
    registry.image_reference(request.image)
    tool = engine.pick(request.engine, "podman")
    if request.input is not None and not request.input.is_dir():
        raise PackagingError(f"input folder {request.input} "
                             f"{'is not a folder' if request.input.exists() else 'does not exist'}")
    if request.config is not None and not request.config.is_file():
        raise PackagingError(f"--config {request.config}: not a file")
    for flag, path in (("-i", request.input), ("-o", request.output), ("--config", request.config)):
        if path is not None and ":" in str(path.resolve()):
            raise PackagingError(f"{flag} {path}: the engines' -v SOURCE:TARGET cannot mount a path holding ':'; "
                                 "rename it, or copy it to a path without one")
    if request.input is not None:
        _check_links_stay_inside(request.input)
    if request.output is not None:
        _check_output(request.output)
    wanted_gpus(request.gpus)
    app, pkg = read_manifests(request.image, tool)
    if request.output is not None:
        _make_output(request.output)
    else:
        logger.warning("no -o: what the app writes stays in its container, which is removed when the app ends")
    return run_argv(request, tool, app, pkg)


APP_EXIT_RE = re.compile(r"Application exited with (\d+)\.")


def app_exit_code(container_code: int, log: str) -> int:
    """The app's exit status: the official entrypoint (tools.sh, packaged unchanged) logs "Application exited
    with N." but itself exits 0, so a zero container status is overridden by the last such line."""
    if container_code:
        return container_code
    logged = APP_EXIT_RE.findall(log)
    return int(logged[-1]) if logged else 0


def run(request: RunRequest) -> int:
    """Run the MAP in the foreground, echoing its log; returns the app's exit status. Ctrl-C, SIGTERM or SIGHUP
    removes the container before KeyboardInterrupt goes on: the engine passes the signal to the official entrypoint
    only, which, as the container's first process, ignores it, so the app would run on unattended."""
    last_exit_line = ""
    # The engine once: the removals below must not ask `docker info` again each time.
    request = replace(request, engine=engine.pick(request.engine, "podman"))
    with termination_as_interrupt():
        argv = prepare(request)  # an interruption here: the manifests' container is removed on the way out
        logger.info("running: %s", " ".join(argv))
        # Not `with Popen(...)`: its exit waits for the engine after any interruption but Ctrl-C's own class.
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        try:
            for line in process.stdout:
                sys.stdout.write(line)
                if APP_EXIT_RE.search(line):
                    last_exit_line = line
            process.wait()
        except KeyboardInterrupt:
            # Again every second until the engine's client ends with its container: a removal that came before
            # the engine had created the container found none.
            deadline = time.monotonic() + 30
            while True:
                remove_container(request)
                try:
                    process.wait(timeout=1)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        process.kill()
                        break
            raise
        finally:
            process.stdout.close()
    return app_exit_code(process.returncode, last_exit_line)


def remove_container(request: RunRequest) -> None:
    """Remove the container `request` started (by its name), at once; quiet when it is gone already."""
    tool = engine.pick(request.engine, "podman")
    # No grace period: the entrypoint ignores SIGTERM, so podman's default stop would only wait 10 s for nothing.
    at_once = ["--time", "0"] if tool == "podman" else []  # docker rm --force kills at once
    removed = subprocess.run([*engine.base_command(tool), "rm", "--force", *at_once, request.name],
                             capture_output=True, text=True, timeout=120)
    if removed.returncode == 0:
        logger.info("removed container %s", request.name)
    else:  # it may not have been created yet, or have ended on its own meanwhile
        logger.debug("removing container %s: %s", request.name, removed.stderr.strip())
