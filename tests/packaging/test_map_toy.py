"""A small MAP built for real with buildah (overlay, chroot isolation) from the local base image, then
inspected, run with podman (runc), pushed to and pulled from a loopback registry."""

from __future__ import annotations

import json
import platform as host_platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import SESSION, free_port, podman, podman_run, remove_image
from medserve.cli import main as cli_main
from medserve.errors import PackagingError
from medserve.packaging import registry as reg
from medserve.packaging.build import PackageRequest, package
from medserve.packaging.config import read_app_config
from medserve.packaging.containerfile import user_setup
from medserve.packaging.context import app_requirements
from medserve.packaging.manifest import find_app
from medserve.packaging.run import RunRequest, inspect, run

TAG = f"localhost/medserve-test-toy:{SESSION}"
APP = '''\
import os, pathlib, sys, time, yaml
if sys.argv[1:2] == ["--sleep"]:  # a run that is still going when the test interrupts it
    time.sleep(float(sys.argv[2]))
out = pathlib.Path(os.environ["HOLOSCAN_OUTPUT_PATH"])
inp = pathlib.Path(os.environ["HOLOSCAN_INPUT_PATH"])
models = sorted(os.listdir(os.environ["HOLOSCAN_MODEL_PATH"]))
config = yaml.safe_load(open(os.environ["HOLOSCAN_CONFIG_PATH"]))
(out / "result.json").write_text(yaml.safe_dump({"inputs": sorted(p.name for p in inp.iterdir()),
    "models": models, "title": config["application"]["title"], "cwd": os.getcwd()}))
'''
TITLE = "Toy MAP – Rétine $HOME"  # labels keep non-ASCII text and `$` as written
CONFIG = f"""\
application:
  title: {TITLE}
  version: "0.3"
  input-formats: ["file"]
  output-formats: ["file"]
resources:
  cpu: 1
  gpu: 0
  memory: 1Gi
"""


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory, wheel_dir_for) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("toy")
    (root / "app").mkdir()
    (root / "app" / "app.py").write_text(APP)
    (root / "app" / "requirements.txt").write_text("pyyaml==6.0.4\n")
    # what the official .dockerignore keeps out of an image
    (root / "app" / ".env").write_text("TOKEN=s3cret\n")
    (root / "app" / ".venv").mkdir()
    (root / "app" / "run.log").write_text("log\n")
    (root / "app.yaml").write_text(CONFIG)
    bundle = root / "toy_bundle"
    (bundle / "configs").mkdir(parents=True)
    (bundle / "models").mkdir()
    (bundle / "configs" / "metadata.json").write_text("{}")
    (bundle / "configs" / "inference.json").write_text("{}")
    torch.save({"weight": torch.zeros(1)}, bundle / "models" / "model.pt")
    (root / "docs").mkdir()
    (root / "docs" / "README.md").write_text("toy docs\n")
    # pyyaml plus the MONAI Deploy App SDK and Holoscan every MAP gets
    wheels = wheel_dir_for(app_requirements(find_app(root / "app"), read_app_config(root / "app.yaml")))
    return {"root": root, "app": root / "app", "config": root / "app.yaml", "models": bundle, "wheels": wheels,
            "docs": root / "docs"}


@pytest.fixture(scope="session")
def toy_image(base_image: str, toy: dict[str, Path]) -> str:
    remove_image(TAG)
    result = package(PackageRequest(toy["app"], toy["config"], TAG, models=toy["models"], base_image=base_image,
                                    builder="buildah", wheel_dir=toy["wheels"], variant="cpu", docs=toy["docs"]))
    assert result.builder == "buildah" and result.variant == "cpu"
    yield TAG
    remove_image(TAG)


def test_layout_manifests_labels_env(toy_image: str) -> None:
    info = inspect(toy_image, "podman")
    assert info["labels"]["org.opencontainers.image.title"] == TITLE
    assert info["labels"]["org.opencontainers.image.version"] == "0.3"
    # the SDK and Holoscan the labels and app.json record are the ones installed, though the app names neither
    installed = podman_run(toy_image, "-c", "from importlib.metadata import version as v; "
                           "print(v('monai-deploy-app-sdk'), v('holoscan-cu13'))", entrypoint="python3")
    assert installed.stdout.split() == [info["labels"]["org.monai.deploy.app-sdk"],
                                        info["labels"]["org.nvidia.holoscan"]], installed.stderr
    assert info["app.json"]["sdkVersion"] == info["labels"]["org.monai.deploy.app-sdk"]
    assert info["app.json"]["command"] == '["python3", "/opt/holoscan/app/app.py"]'
    assert info["app.json"]["input"] == {"path": "input/", "formats": ["file"]}
    assert info["pkg.json"]["models"] == {"toy_bundle": "/opt/holoscan/models/toy_bundle"}
    assert info["pkg.json"]["resources"] == {"cpu": 1, "gpu": 0, "memory": "1Gi"}

    config = json.loads(podman("image", "inspect", toy_image).stdout)[0]["Config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["HOLOSCAN_INPUT_PATH"] == "/var/holoscan/input"
    assert env["HOLOSCAN_MODEL_PATH"] == "/opt/holoscan/models"
    for name in ("OUTPUT_PATH", "WORKDIR", "APPLICATION", "TIMEOUT", "DOCS_PATH", "CONFIG_PATH",
                 "APP_MANIFEST_PATH", "PKG_MANIFEST_PATH", "LOGS_PATH", "VERSION"):
        assert f"HOLOSCAN_{name}" in env
    assert config["Entrypoint"] == ["/var/holoscan/tools"]
    assert config["WorkingDir"].rstrip("/") == "/var/holoscan"

    listing = podman_run(toy_image,
                     "/opt/holoscan/app", "/opt/holoscan/models", "/opt/holoscan/docs", "/opt/holoscan/lib/medserve",
                     "/var/holoscan", "-maxdepth", "3", entrypoint="find").stdout.split()
    for path in ("/opt/holoscan/app/app.py", "/opt/holoscan/models/toy_bundle/models/model.pt",
                 "/opt/holoscan/docs/README.md", "/opt/holoscan/lib/medserve/errors.py", "/var/holoscan/app.yaml",
                 "/var/holoscan/input", "/var/holoscan/output", "/var/holoscan/tools"):
        assert path in listing, path
    assert not any(path.endswith(("/.env", "/.venv", "/run.log")) for path in listing)
    # the CA bundle and wheels were mounted into the pip step only, never copied into the image
    assert podman_run(toy_image, "/tmp/pip", entrypoint="ls").returncode != 0
    assert podman_run(toy_image, "/opt/holoscan/app", entrypoint="ls").returncode == 0
    # its environment is what its requirements say (pyyaml), not a cached one from another MAP
    assert podman_run(toy_image, "-c", "import yaml", entrypoint="python3").returncode == 0
    assert podman_run(toy_image, "-c", "import torch", entrypoint="python3").returncode != 0


def _tools(image: str, *args: str, volumes: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return podman_run(image, *args, volumes=volumes)


def test_entrypoint_show_env_extract(toy_image: str, toy: dict[str, Path], tmp_path: Path) -> None:
    shown = _tools(toy_image, "show", "pkg")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout[shown.stdout.index("{"):])["models"] == {
        "toy_bundle": "/opt/holoscan/models/toy_bundle"}
    env = _tools(toy_image, "env").stdout
    assert "HOLOSCAN_APP_MANIFEST_PATH=/etc/holoscan/app.json" in env
    export = tmp_path / "export"
    export.mkdir()
    export.chmod(0o777)  # the image's holoscan user (UID 1000) writes there, as with the official image
    result = _tools(toy_image, "extract", volumes=(f"{export}:/var/run/holoscan/export",))
    assert result.returncode == 0, result.stderr
    assert (export / "app" / "app.py").is_file()
    assert json.loads((export / "config" / "app.json").read_text())["version"] == "0.3"
    assert (export / "config" / "app.yaml").is_file()
    assert (export / "models" / "toy_bundle" / "models" / "model.pt").read_bytes() == (
        toy["models"] / "models" / "model.pt").read_bytes()
    assert (export / "docs" / "README.md").is_file()


def test_run_mounts_input_output(toy_image: str, tmp_path: Path) -> None:
    import yaml

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.dcm").write_bytes(b"x")
    (tmp_path / "in" / "b.dcm").write_bytes(b"y")
    assert run(RunRequest(toy_image, tmp_path / "in", tmp_path / "out", engine="podman")) == 0
    result = yaml.safe_load((tmp_path / "out" / "result.json").read_text())
    assert result == {"inputs": ["a.dcm", "b.dcm"], "models": ["toy_bundle"], "title": TITLE,
                      "cwd": "/var/holoscan"}


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interrupted_run_removes_its_container(toy_image: str, tmp_path: Path, stop: signal.Signals) -> None:
    """Ctrl-C, SIGTERM or a closed terminal (SIGHUP) on `medserve run` ends the container too (its entrypoint,
    the container's first process, ignores the signal the engine passes on), and the exit status says which
    signal it was."""
    def containers(running_only: bool = False) -> list[str]:
        listed = podman("ps", "--all", "--filter", f"ancestor={toy_image}", "--format", "{{.Names}} {{.Command}}")
        assert listed.returncode == 0, listed.stderr
        names = [line.split()[0] for line in listed.stdout.splitlines()]
        # the one `run` started, not the one it creates (never started) to read the manifests first
        return [name for name in names if name.startswith("medserve-run-")] if running_only else names

    assert containers() == []
    process = subprocess.Popen([sys.executable, "-m", "medserve.cli", "run", toy_image, "-o", str(tmp_path / "out"),
                                "--engine", "podman", "--", "--sleep", "300"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not containers(running_only=True):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the container never started"
            time.sleep(0.2)
        process.send_signal(stop)
        _, err = process.communicate(timeout=60)
        left = containers()
    finally:
        process.kill()
        for name in containers():
            podman("rm", "--force", "--time", "0", name)
    assert process.returncode == 128 + stop, err
    assert f"error: interrupted by {stop.name}" in err
    assert left == []


def test_run_missing_image_leaves_no_output(container_tools: None, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    image = f"localhost/medserve-test-absent:{SESSION}"
    assert cli_main(["run", image, "-o", str(tmp_path / "out"), "--engine", "podman"]) == 2
    assert f"error: {image} is not in podman's local image store" in capsys.readouterr().err  # no pull tried
    assert not (tmp_path / "out").exists()


def test_user_setup_with_a_uid_1000_user_in_the_base(base_image: str) -> None:
    """Base images such as ubuntu:24.04 already have a UID 1000 user (`ubuntu`): the official template removes it."""
    script = f"useradd -m -u 1000 ubuntu && {user_setup(1000, 1000)} && id -u holoscan && id -g holoscan " \
             "&& ! id ubuntu 2>/dev/null"
    result = podman_run(base_image, "-c", f"set -e; {script}", entrypoint="bash")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1000", "1000"]


def test_cli_run_missing_input(toy_image: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["run", toy_image, "-i", str(tmp_path / "absent"), "-o", str(tmp_path / "out")]) == 2
    assert f"error: input folder {tmp_path / 'absent'} does not exist" in capsys.readouterr().err


def test_rebuild_reuses_dependency_layer(toy_image: str, toy: dict[str, Path], base_image: str) -> None:
    """Changing only the app must not reinstall the Python environment (the slow layer)."""
    def layers(tag: str) -> list[str]:
        return json.loads(podman("image", "inspect", tag).stdout)[0]["RootFS"]["Layers"]

    app2 = toy["root"] / "app2"
    app2.mkdir(exist_ok=True)
    (app2 / "app.py").write_text(APP + "# changed\n")
    (app2 / "requirements.txt").write_text("pyyaml==6.0.4\n")
    tag = f"localhost/medserve-test-toy:{SESSION}-changed"
    try:
        result = package(PackageRequest(app2, toy["config"], tag, models=toy["models"], base_image=base_image,
                                        builder="buildah", wheel_dir=toy["wheels"], variant="cpu", docs=toy["docs"]))
        old, new = layers(toy_image), layers(tag)
        assert old[:3] == new[:3]  # base, user/dirs, venv
        assert old[-1] != new[-1]  # the app layer
        assert result.seconds < 60
    finally:
        remove_image(tag)


def test_changed_requirements_rebuild_dependency_layer(toy_image: str, toy: dict[str, Path], base_image: str) -> None:
    """The pip step bind-mounts its inputs, which the layer cache cannot see: new pins must still rebuild it."""
    def layers(tag: str) -> list[str]:
        return json.loads(podman("image", "inspect", tag).stdout)[0]["RootFS"]["Layers"]

    app3 = toy["root"] / "app3"
    app3.mkdir(exist_ok=True)
    (app3 / "app.py").write_text(APP)
    (app3 / "requirements.txt").write_text("pyyaml>=6\n")  # same wheel, different requirement
    tag = f"localhost/medserve-test-toy:{SESSION}-newpins"
    try:
        package(PackageRequest(app3, toy["config"], tag, models=toy["models"], base_image=base_image,
                               builder="buildah", wheel_dir=toy["wheels"], variant="cpu", docs=toy["docs"]))
        old, new = layers(toy_image), layers(tag)
        assert old[:2] == new[:2] and old[2] != new[2]
    finally:
        remove_image(tag)


def test_push_pull_digests_match_and_run_from_registry(toy_image: str, registry, tmp_path: Path) -> None:
    host = registry()
    reference = f"{host}/medserve/toy:{SESSION}"
    digest = reg.push(toy_image, reference, "buildah")
    assert digest.startswith("sha256:")
    assert reg.remote_digest(reference) == digest
    catalog = json.load(__import__("urllib.request").request.urlopen(f"http://{host}/v2/_catalog"))
    assert "medserve/toy" in catalog["repositories"]
    remove_image(reference)
    reg.pull(reference, "podman")
    repo_digests = json.loads(podman("image", "inspect", reference).stdout)[0]["RepoDigests"]
    assert f"{host}/medserve/toy@{digest}" in repo_digests
    # and it runs straight from the plain-HTTP registry, no extra flags
    remove_image(reference)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x").write_bytes(b"1")
    assert cli_main(["run", reference, "-i", str(tmp_path / "in"), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "result.json").is_file()
    remove_image(reference)


def test_push_and_pull_unreachable_registry(toy_image: str) -> None:
    """One line naming the registry and the tool's error, without its progress lines and retries' warnings
    (hundreds of characters of them were on the line)."""
    port = free_port()  # nothing listens there
    with pytest.raises(PackagingError, match=rf"registry 127.0.0.1:{port} is unreachable: Error: ") as pushing:
        reg.push(toy_image, f"127.0.0.1:{port}/medserve/toy:0.3", "buildah")
    assert "Copying blob" not in str(pushing.value) and "connection refused" in str(pushing.value)
    with pytest.raises(PackagingError, match=rf"registry 127.0.0.1:{port} is unreachable: Error: ") as pulling:
        reg.pull(f"127.0.0.1:{port}/medserve/toy:0.3", "podman")
    assert "level=warning" not in str(pulling.value) and str(pulling.value).count("connection refused") == 1


def test_push_credentials(toy_image: str, registry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    host = registry(users={"alice": "correct-horse"})
    reference = f"{host}/medserve/toy:{SESSION}"
    with pytest.raises(PackagingError, match="rejected no credentials"):
        reg.push(toy_image, reference, "buildah")
    monkeypatch.setenv("MEDSERVE_REGISTRY_USER", "alice")
    with pytest.raises(PackagingError, match=r"rejected no credentials \(MEDSERVE_REGISTRY_PASSWORD is not set"):
        reg.push(toy_image, reference, "buildah")
    monkeypatch.setenv("MEDSERVE_REGISTRY_PASSWORD", "wrong-password")
    with pytest.raises(PackagingError,
                       match="rejected credentials from MEDSERVE_REGISTRY_USER/MEDSERVE_REGISTRY_PASSWORD"):
        reg.push(toy_image, reference, "buildah")
    monkeypatch.setenv("MEDSERVE_REGISTRY_PASSWORD", "correct-horse")
    digest = reg.push(toy_image, reference, "buildah")
    assert reg.remote_digest(reference) == digest
    # the token never lands in the usual auth files
    for auth in (Path.home() / ".config/containers/auth.json", Path("/run/containers/0/auth.json"),
                 Path.home() / ".docker/config.json"):
        assert not auth.exists() or "correct-horse" not in auth.read_text()


def test_run_and_inspect_pull_with_credentials(toy_image: str, registry, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """A MAP in a registry that wants credentials: run and inspect pull it with them (not `podman create`'s
    anonymous pull)."""
    host = registry(users={"alice": "correct-horse"})
    reference = f"{host}/medserve/toy:{SESSION}-auth"
    monkeypatch.setenv("MEDSERVE_REGISTRY_USER", "alice")
    monkeypatch.setenv("MEDSERVE_REGISTRY_PASSWORD", "correct-horse")
    reg.push(toy_image, reference, "buildah")
    remove_image(reference)
    try:
        assert inspect(reference, "podman")["pkg.json"]["models"] == {"toy_bundle": "/opt/holoscan/models/toy_bundle"}
        remove_image(reference)
        (tmp_path / "in").mkdir()
        assert cli_main(["run", reference, "-i", str(tmp_path / "in"), "-o", str(tmp_path / "out")]) == 0
        assert (tmp_path / "out" / "result.json").is_file()
    finally:
        remove_image(reference)


def test_ghcr_credentials_from_env() -> None:
    env = {"GHCR_USER": "octo", "GHCR_TOKEN": "t0k"}
    creds = reg.credentials_from_env("ghcr.io", env)
    assert creds is not None and (creds.username, creds.password) == ("octo", "t0k")
    assert reg.credentials_from_env("quay.io", env) is None
    actions = reg.credentials_from_env("ghcr.io", {"GITHUB_ACTOR": "bot", "GITHUB_TOKEN": "x"})
    assert actions is not None and actions.source == "GITHUB_ACTOR/GITHUB_TOKEN"


def test_a_failed_build_leaves_no_working_container(base_image: str, toy: dict[str, Path], tmp_path: Path) -> None:
    """A build whose step fails (here pip: a requirement that is not among the wheels) leaves no buildah working
    container behind."""
    def working_containers() -> list[str]:
        from medserve.packaging.engine import base_command

        listed = subprocess.run([*base_command("buildah"), "containers", "--quiet"], capture_output=True, text=True)
        assert listed.returncode == 0, listed.stderr
        return listed.stdout.split()

    app = tmp_path / "app"
    shutil.copytree(toy["app"], app)
    with (app / "requirements.txt").open("a") as requirements:
        requirements.write("medserve-test-no-such-package==1.0\n")
    before = working_containers()
    with pytest.raises(PackagingError, match="building"):
        package(PackageRequest(app, toy["config"], f"{TAG}-failed", models=toy["models"], base_image=base_image,
                               builder="buildah", wheel_dir=toy["wheels"], variant="cpu"))
    assert working_containers() == before


_ARM_HOST = host_platform.machine() in ("aarch64", "arm64")
_HOST_PLATFORM, _FOREIGN_PLATFORM, _FOREIGN_ARCH = ("sbsa", "x86_64", "amd64") if _ARM_HOST else ("x86_64", "sbsa",
                                                                                                   "arm64")


@pytest.mark.parametrize(("platform", "base", "message"), [
    (_FOREIGN_PLATFORM, None, f"--platform {_FOREIGN_PLATFORM} builds linux/{_FOREIGN_ARCH}"),
    (_HOST_PLATFORM, f"localhost/medserve-test-absent-base:{SESSION}", "is not in the local store"),
])
def test_a_local_base_image_that_cannot_serve_is_refused_before_the_build(base_image: str, toy: dict[str, Path],
                                                                          platform: str, base: str | None,
                                                                          message: str) -> None:
    """Rather than the builder's search for it on a registry named `localhost` (connection refused, after
    retries)."""
    started = time.monotonic()
    with pytest.raises(PackagingError, match=message):
        package(PackageRequest(toy["app"], toy["config"], f"{TAG}-refused", models=toy["models"],
                               base_image=base or base_image, builder="buildah", wheel_dir=toy["wheels"],
                               variant="cpu", platform=platform))
    assert time.monotonic() - started < 10
