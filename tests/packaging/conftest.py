"""Real tools for the MAP tests: a base image built locally once (debootstrap + podman import, reused from the
local store when already there), throwaway registries (Debian docker-registry on 127.0.0.1, free port), a wheel
directory downloaded once with the host's pip configuration."""

from __future__ import annotations

import crypt  # bcrypt htpasswd lines for the registry (libxcrypt); deprecated but present on 3.11
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from medserve.packaging import layout
from medserve.packaging.base import build_base_image, image_exists

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("buildah", "podman", "skopeo", "runc", "debootstrap", "docker-registry")
# Image tags are per test session: several sessions (a developer's and `make test`) may share one image store.
SESSION = f"s{os.getpid()}"


def _missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


@pytest.fixture(scope="session")
def container_tools() -> None:
    missing = _missing_tools()
    if missing:
        pytest.skip(f"MAP tests need {', '.join(missing)}: run `bash .ci/system-deps` (CI installs them)")


@pytest.fixture(scope="session")
def base_image(container_tools: None) -> str:
    if not image_exists(layout.DEFAULT_BASE_IMAGE):
        build_base_image(layout.DEFAULT_BASE_IMAGE)
    return layout.DEFAULT_BASE_IMAGE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RegistryFactory = Callable[..., str]


@pytest.fixture
def registry(container_tools: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryFactory]:
    """start(users={name: password}) -> '127.0.0.1:PORT', a plain-HTTP registry on loopback."""
    processes: list[subprocess.Popen] = []

    def start(users: dict[str, str] | None = None) -> str:
        root = tmp_path_factory.mktemp("registry")
        port = free_port()
        auth = ""
        if users:
            lines = [f"{u}:{crypt.crypt(p, crypt.mksalt(crypt.METHOD_BLOWFISH))}" for u, p in users.items()]
            (root / "htpasswd").write_text("\n".join(lines) + "\n")
            auth = f"auth:\n  htpasswd:\n    realm: test\n    path: {root / 'htpasswd'}\n"
        (root / "config.yml").write_text(
            f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
            f"http:\n  addr: 127.0.0.1:{port}\n{auth}"
        )
        log = open(root / "registry.log", "w")
        process = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")], stdout=log,
                                   stderr=subprocess.STDOUT)
        processes.append(process)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1)
                return f"127.0.0.1:{port}"
            except urllib.error.HTTPError:  # 401 with auth on: it is up
                return f"127.0.0.1:{port}"
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError(f"registry exited: {(root / 'registry.log').read_text()}")
                time.sleep(0.1)
        raise RuntimeError("registry did not start within 20 s")

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def wheel_dir_for() -> Callable[[list[str]], Path]:
    """Wheels for a MAP's requirement lines, downloaded once (host pip config) and kept in ~/.cache/medserve."""
    from medserve.packaging.wheels import download_wheels

    return lambda requirements: download_wheels(requirements, Path.home() / ".cache" / "medserve")


def podman(*args: str, **kwargs) -> subprocess.CompletedProcess:
    from medserve.packaging.engine import base_command

    return subprocess.run([*base_command("podman"), *args], capture_output=True, text=True, **kwargs)


def remove_image(tag: str) -> None:
    """Drop the tag only: `podman rmi` would also delete the untagged parent layers that are the build cache
    (the 1.6 GB Python environment), making every test run a cold build. `podman image prune` reclaims them."""
    podman("untag", tag, tag)  # with no name given, untag would drop every name of that image


def podman_run(image: str, *args: str, entrypoint: str | None = None, volumes: tuple[str, ...] = (),
               user: str | None = None) -> subprocess.CompletedProcess:
    """`podman run` as medserve runs MAPs here: runc, no network, ulimits runc may set in a CI sandbox."""
    from medserve.packaging.run import ulimits

    argv = ["--runtime", "runc", "run", "--rm", "--network", "none"]
    for limit in ulimits("podman"):
        argv += ["--ulimit", limit]
    for volume in volumes:
        argv += ["-v", volume]
    if entrypoint is not None:
        argv += ["--entrypoint", entrypoint]
    if user is not None:
        argv += ["--user", user]
    return podman(*argv, image, *args)
