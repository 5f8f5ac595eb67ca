"""End to end: the MAP of apps/bundle_seg with the demo bundle, built with buildah from the local base image,
run with podman on the demo study (directly, and served by name by the model server), must write the same
DICOM SEG as `python apps/bundle_seg/app.py`."""

from __future__ import annotations

import io
import json
import resource
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import highdicom as hd
import httpx
import numpy as np
import pydicom
import pytest
import uvicorn

from conftest import REPO, SESSION, free_port, podman, podman_run, remove_image
from medserve.cli import main as cli_main
from medserve.packaging.config import read_app_config
from medserve.packaging.context import app_requirements
from medserve.packaging.manifest import find_app
from medserve.packaging.run import inspect
from medserve.server.app import create_app
from medserve.server.config import ServerConfig

TAG = f"localhost/medserve-test-bundle-seg:{SESSION}"
APP = REPO / "apps" / "bundle_seg"
BUNDLE = REPO / "bundles" / "demo_organ_seg"
pytestmark = pytest.mark.slow


def _big_stack() -> None:
    resource.setrlimit(resource.RLIMIT_STACK, (32 * 1024 * 1024, 32 * 1024 * 1024))


@pytest.fixture(scope="module")
def bundle_seg_map(base_image: str, wheel_dir_for) -> str:
    requirements = app_requirements(find_app(APP), read_app_config(REPO / "app.yaml"))
    wheels = wheel_dir_for(requirements)
    code = cli_main(["package", str(APP), "-c", str(REPO / "app.yaml"), "-t", TAG, "-m", str(BUNDLE),
                     "--platform", "x86_64", "--base-image", base_image, "--builder", "buildah",
                     "--wheel-dir", str(wheels), "--variant", "cpu"])
    assert code == 0
    yield TAG
    remove_image(TAG)


@pytest.fixture(scope="module")
def demo_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    study = tmp_path_factory.mktemp("demo") / "study"
    subprocess.run([sys.executable, "-m", "medserve.demo.study", str(study)], check=True, cwd=REPO)
    assert any(study.rglob("*.dcm"))
    return study


@pytest.fixture(scope="module")
def direct_seg(demo_study: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SEG `python apps/bundle_seg/app.py` writes for the demo study: what every MAP run must reproduce."""
    out = tmp_path_factory.mktemp("direct")
    direct = subprocess.run([sys.executable, str(APP / "app.py"), "-i", str(demo_study), "-o", str(out),
                             "-m", str(BUNDLE)], cwd=REPO, capture_output=True, text=True, preexec_fn=_big_stack)
    assert direct.returncode == 0, direct.stderr[-2000:]
    segs = sorted(out.rglob("*.dcm"))
    assert len(segs) == 1
    return segs[0]


def _seg_volume(path: Path) -> hd.Volume:
    return hd.seg.segread(path).get_volume(combine_segments=True)


def test_map_layout(bundle_seg_map: str) -> None:
    info = inspect(bundle_seg_map, "podman")
    assert info["app.json"]["command"] == '["python3", "/opt/holoscan/app"]'  # __main__.py: a Python module
    assert info["app.json"]["sdk"] == "monai-deploy" and info["app.json"]["sdkVersion"] == "4.0.0"
    assert info["pkg.json"]["models"] == {"demo_organ_seg": "/opt/holoscan/models/demo_organ_seg"}
    assert info["pkg.json"]["resources"] == read_app_config(REPO / "app.yaml").resources
    assert info["labels"]["org.medserve.variant"] == "cpu"
    listing = podman_run(bundle_seg_map, "/opt/holoscan", "-maxdepth", "4", entrypoint="find").stdout.split()
    for relative in ("app/app.py", "app/__main__.py", "lib/medserve/pipeline.py", "lib/operators/__init__.py",
                     "models/demo_organ_seg/configs/inference.json", "models/demo_organ_seg/models/model.pt"):
        assert f"/opt/holoscan/{relative}" in listing, relative
    versions = podman_run(bundle_seg_map, "-c", "import torch, holoscan; print(torch.__version__, torch.version.cuda)",
                          entrypoint="python3")
    assert versions.returncode == 0, versions.stderr
    assert versions.stdout.split()[1] == "None"  # CPU variant: no CUDA torch


def test_map_seg_matches_direct_run(bundle_seg_map: str, demo_study: Path, direct_seg: Path, tmp_path: Path) -> None:
    assert cli_main(["run", bundle_seg_map, "-i", str(demo_study), "-o", str(tmp_path / "map")]) == 0

    map_seg = sorted((tmp_path / "map").rglob("*.dcm"))
    assert len(map_seg) == 1
    ours, theirs = hd.seg.segread(map_seg[0]), hd.seg.segread(direct_seg)
    assert ours.SOPClassUID == pydicom.uid.SegmentationStorage
    assert [s.SegmentLabel for s in ours.SegmentSequence] == [s.SegmentLabel for s in theirs.SegmentSequence]
    assert ours.ReferencedSeriesSequence[0].SeriesInstanceUID == theirs.ReferencedSeriesSequence[0].SeriesInstanceUID
    ours_volume = ours.get_volume(combine_segments=True)
    theirs_volume = theirs.get_volume(combine_segments=True)
    assert ours_volume.array.shape == theirs_volume.array.shape
    assert np.array_equal(ours_volume.array, theirs_volume.array)
    assert np.allclose(ours_volume.affine, theirs_volume.affine)
    assert ours_volume.array.any(), "the demo study must produce a non-empty segmentation"


def test_map_runs_as_a_uid_the_image_does_not_know(bundle_seg_map: str, demo_study: Path, direct_seg: Path,
                                                    tmp_path: Path) -> None:
    """`docker run --user` of any host user: HOME is then a folder that user cannot write (the SDK's imports
    create caches there), and the app must still run."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    result = podman_run(bundle_seg_map, user="4321:4321",
                        volumes=(f"{demo_study}:/var/holoscan/input:ro", f"{out}:/var/holoscan/output"))
    assert "Permission denied" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert (out / "seg.dcm").is_file(), result.stderr[-3000:]  # the entrypoint exits 0 whatever the app does
    assert np.array_equal(_seg_volume(out / "seg.dcm").array, _seg_volume(direct_seg).array)


def test_map_run_reports_the_apps_failure(bundle_seg_map: str, tmp_path: Path) -> None:
    """The entrypoint exits 0 whatever the app does: `medserve run` must still fail when the app fails."""
    study = tmp_path / "not_a_study"
    study.mkdir()
    (study / "readme.txt").write_text("no DICOM here")
    assert cli_main(["run", bundle_seg_map, "-i", str(study), "-o", str(tmp_path / "out")]) != 0
    assert not (tmp_path / "out" / "seg.dcm").exists()


@pytest.fixture(scope="module")
def seg_only_map(bundle_seg_map: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A MAP whose app writes the SEG and no NIfTI label map, as many published MAPs do."""
    tag = _derived_map(bundle_seg_map, "seg-only", lambda command: [*command, "--no-nifti"], tmp_path_factory)
    yield tag
    remove_image(tag)


@pytest.fixture(scope="module")
def slow_map(bundle_seg_map: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A MAP whose app takes five minutes (and writes nothing): a request of it is still running when a test
    wants it to be."""
    tag = _derived_map(bundle_seg_map, "slow", lambda command: ["sleep", "300"], tmp_path_factory)
    yield tag
    remove_image(tag)


def _derived_map(image: str, suffix: str, command: Callable[[list[str]], list[str]],
                 tmp_path_factory: pytest.TempPathFactory) -> str:
    """`image` with the command in its app.json changed by `command` (one layer on top, made with buildah)."""
    from medserve.packaging import layout
    from medserve.packaging.engine import base_command

    read = podman_run(image, layout.APP_MANIFEST_PATH, entrypoint="cat")
    assert read.returncode == 0, read.stderr
    manifest = json.loads(read.stdout)
    manifest["command"] = json.dumps(command(json.loads(manifest["command"])))
    path = tmp_path_factory.mktemp(suffix) / "app.json"
    path.write_text(json.dumps(manifest))
    tag = f"{TAG}-{suffix}"
    buildah = base_command("buildah")
    container = subprocess.run([*buildah, "from", "--pull-never", image], capture_output=True, text=True,
                               check=True).stdout.strip()
    subprocess.run([*buildah, "copy", "--chmod", "0644", container, str(path), layout.APP_MANIFEST_PATH],
                   capture_output=True, check=True)
    subprocess.run([*buildah, "commit", "--rm", container, tag], capture_output=True, check=True)
    return tag


class MapServer:
    """The server of `map_server`: its URL, and a stop that ends it as SIGTERM would (lifespan shutdown)."""

    def __init__(self, url: str, server: uvicorn.Server, thread: threading.Thread) -> None:
        self.url, self._server, self._thread = url, server, thread

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the server did not stop within 60 s"


@pytest.fixture
def map_server(bundle_seg_map: str, seg_only_map: str, slow_map: str, tmp_path: Path) -> Iterator[MapServer]:
    """The model server in a thread on 127.0.0.1, over a store holding only MAP descriptors: the session's
    bundle_seg image, one of it that writes no NIfTI, a slow one, and one naming an image that does not exist."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "seg.map.json").write_text(json.dumps({"image": bundle_seg_map, "engine": "podman"}))
    (store / "seg_only.map.json").write_text(json.dumps({"image": seg_only_map, "engine": "podman"}))
    (store / "slow.map.json").write_text(json.dumps({"image": slow_map, "engine": "podman"}))
    (store / "ghost.map.json").write_text(json.dumps({"image": f"localhost/medserve-test-no-such-map:{SESSION}"}))
    config = ServerConfig(store=store, data_dir=tmp_path / "data", port=free_port(), poll_interval=0.1,
                          stable_seconds=0.2, device="cpu")
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=config.port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"
    deadline = time.monotonic() + 60
    while True:  # ready once both descriptors are checked: the image's manifests read, or the failure recorded
        try:
            states = {m["name"]: m["state"] for m in httpx.get(url + "/v1/models", timeout=2).json()["models"]}
            if states == {"seg": "available", "seg_only": "available", "slow": "available", "ghost": "failed"}:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not check the MAP descriptors within 60 s"
        time.sleep(0.1)
    running = MapServer(url, server, thread)
    yield running
    running.stop()


def _study_zip(study: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(study.rglob("*.dcm")):
            archive.write(path, path.relative_to(study).as_posix())
    return buffer.getvalue()


def test_map_served_by_name(map_server: MapServer, demo_study: Path, direct_seg: Path, tmp_path: Path) -> None:
    url = map_server.url
    models = {m["name"]: m for m in httpx.get(url + "/v1/models").json()["models"]}
    assert models["seg"]["kind"] == "map" and models["seg"]["image"].endswith(f"bundle-seg:{SESSION}")
    assert "medserve-test-no-such-map" in models["ghost"]["error"]

    study_zip = _study_zip(demo_study)

    missing = httpx.post(url + "/v1/models/ghost/infer", content=study_zip,
                         headers={"Content-Type": "application/zip"}, timeout=120)
    assert missing.status_code == 409, missing.text
    assert missing.json()["error"] == "model_failed"
    assert f"medserve-test-no-such-map:{SESSION}" in missing.json()["message"]

    # A study the app cannot segment (only a SEG, no image series): the container exits non-zero -> 500 with
    # the tail of its log, and no result.
    broken = httpx.post(url + "/v1/models/seg/infer", files={"file": ("seg.dcm", direct_seg.read_bytes())},
                        timeout=300)
    assert broken.status_code == 500, broken.text
    assert broken.json()["error"] == "map_failed", broken.text
    assert "exited with 2" in broken.json()["message"] and "matches the selection rules" in broken.json()["message"]

    expected = _seg_volume(direct_seg)
    served = httpx.post(url + "/v1/models/seg/infer", content=study_zip,
                        headers={"Content-Type": "application/zip"}, timeout=300)
    assert served.status_code == 200, served.text
    assert served.headers["content-type"] == "application/dicom"
    assert json.loads(served.headers["X-Medserve-Segments"]), "the segment counts come back as for a bundle"
    (tmp_path / "served.dcm").write_bytes(served.content)
    volume = _seg_volume(tmp_path / "served.dcm")
    assert np.array_equal(volume.array, expected.array) and np.allclose(volume.affine, expected.affine)

    job = httpx.post(url + "/v1/jobs?model=seg", content=study_zip,
                     headers={"Content-Type": "application/zip"}, timeout=120)
    assert job.status_code == 202, job.text
    deadline = time.monotonic() + 120
    while (state := httpx.get(url + job.headers["Location"]).json())["state"] not in (
            "succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    assert state["state"] == "succeeded", state
    assert state["outputs"] == ["nifti", "seg"]
    result = httpx.get(url + state["result_url"])
    assert result.status_code == 200
    (tmp_path / "job.dcm").write_bytes(result.content)
    assert np.array_equal(_seg_volume(tmp_path / "job.dcm").array, expected.array)

    # A MAP that writes only the SEG, asked for the NIfTI label map: 406 naming what it can give, counted as such.
    no_nifti = httpx.post(url + "/v1/models/seg_only/infer?format=nifti", content=study_zip,
                          headers={"Content-Type": "application/zip"}, timeout=300)
    assert (no_nifti.status_code, no_nifti.json()["error"]) == (406, "format_unavailable"), no_nifti.text
    assert "produced no nifti output; ask for seg" in no_nifti.json()["message"], no_nifti.text
    counted = [line for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith("medserve_requests_total") and 'model="seg_only"' in line]
    assert counted == ['medserve_requests_total{endpoint="v1",model="seg_only",status="406"} 1.0'], counted


@pytest.mark.parametrize("ending", ["server stop", "job cancel"])
def test_a_running_map_job_that_ends_early_takes_its_container_with_it(map_server: MapServer, slow_map: str,
                                                                       demo_study: Path, ending: str) -> None:
    """A job's container still running when the server stops (past the stop's grace), or when the job is
    cancelled, is removed: the engine would leave it running, writing into the job's folder while the job runs
    again at the next start, or holding the model's slot (and GPU) for a result nobody wants."""
    def containers() -> list[str]:
        listed = podman("ps", "--all", "--filter", f"ancestor={slow_map}", "--format", "{{.Names}}")
        assert listed.returncode == 0, listed.stderr
        return [name for name in listed.stdout.split() if name.startswith("medserve-run-")]

    job = httpx.post(map_server.url + "/v1/jobs?model=slow", content=_study_zip(demo_study),
                     headers={"Content-Type": "application/zip"}, timeout=120)
    assert job.status_code == 202, job.text
    location = map_server.url + job.headers["Location"]
    deadline = time.monotonic() + 120
    while not containers():
        assert time.monotonic() < deadline, httpx.get(location).json()
        time.sleep(0.1)
    try:
        if ending == "server stop":
            map_server.stop()
        else:
            cancelled = httpx.delete(location, timeout=60)
            assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled", cancelled.text
        assert containers() == []
        if ending == "job cancel":  # the worker is free again: the job stays cancelled, not failed
            time.sleep(1)
            assert httpx.get(location).json()["state"] == "cancelled"
    finally:
        for name in containers():
            podman("rm", "--force", "--time", "0", name)


def test_a_stop_while_the_image_is_read_starts_no_container(slow_map: str, demo_study: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop (server stop or job cancel) that comes while the request still reads the image's manifests, before
    the container exists, is not lost: no container starts."""
    from medserve.server import maps
    from medserve.server.errors import ApiError
    from medserve.server.inputs import InputSpec

    real_prepare = maps.prepare

    def prepare_then_stop(request):
        argv = real_prepare(request)
        maps.stop_containers()  # as a cancel would, once the request is known but its container is not
        return argv

    monkeypatch.setattr(maps, "prepare", prepare_then_stop)
    with pytest.raises(ApiError) as stopped:
        maps.MapModel("slow", slow_map, "podman").run(InputSpec("dicom", demo_study), tmp_path / "out")
    assert stopped.value.code == "map_stopped", stopped.value.message
    listed = podman("ps", "--all", "--filter", f"ancestor={slow_map}", "--format", "{{.Names}}")
    assert listed.stdout.split() == []
