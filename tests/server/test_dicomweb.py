"""Round trip with a real Orthanc (DICOMweb plugin) in a loopback-only network namespace: STOW the demo study,
infer by UID (sync and job), STOW the SEG back and find it, store down -> 502 for sync calls and retries with
backoff for jobs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.server.conftest import REPO, add_bundle

ORTHANC = shutil.which("Orthanc")
PLUGIN = Path("/usr/share/orthanc/plugins/libOrthancDicomWeb.so")
pytestmark = pytest.mark.skipif(ORTHANC is None or not PLUGIN.exists(),
                                reason="Debian packages orthanc + orthanc-dicomweb not installed (make system-deps)")


def _ns(ns: str, *cmd: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], **kw)


def _wait_in_ns(ns: str, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                           f"import httpx,sys; sys.exit(httpx.get('{url}', timeout=2).status_code >= 500)"],
                          capture_output=True).returncode == 0:
            return
        time.sleep(0.3)
    raise TimeoutError(url)


@pytest.fixture
def netns() -> str:
    name = f"medserve-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    yield name
    subprocess.run(["ip", "netns", "delete", name], check=False)


def _orthanc_config(tmp: Path) -> Path:
    config = {
        "Name": "medserve-test", "HttpPort": 8042, "DicomPort": 4242, "RemoteAccessAllowed": False,
        "AuthenticationEnabled": False, "StorageDirectory": str(tmp / "storage"), "IndexDirectory": str(tmp / "index"),
        "Plugins": [str(PLUGIN)], "DicomWeb": {"Enable": True, "Root": "/dicom-web/"}, "HttpTimeout": 60,
    }
    path = tmp / "orthanc.json"
    path.write_text(json.dumps(config))
    return path


def test_orthanc_round_trip(netns: str, tmp_path: Path, store_dir: Path, demo_study: Path) -> None:
    add_bundle(store_dir, "demo")
    orthanc_cfg = _orthanc_config(tmp_path)
    orthanc_log = open(tmp_path / "orthanc.log", "wb")
    orthanc = _ns(netns, ORTHANC, str(orthanc_cfg), stdout=orthanc_log, stderr=subprocess.STDOUT)
    server_log = open(tmp_path / "server.log", "wb")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = _ns(netns, sys.executable, "-m", "medserve.cli", "serve", "--store", str(store_dir), "--data-dir",
                 str(tmp_path / "data"), "--port", "8000", "--stable-seconds", "0.5", "--device", "cpu",
                 "--dicomweb", "http://127.0.0.1:8042/dicom-web", stdout=server_log, stderr=subprocess.STDOUT,
                 env=env, cwd=REPO)
    driver = None
    try:
        _wait_in_ns(netns, "http://127.0.0.1:8042/system")
        _wait_in_ns(netns, "http://127.0.0.1:8000/readyz", 120)
        driver = _ns(netns, sys.executable, str(Path(__file__).parent / "netns" / "orthanc_driver.py"),
                     str(demo_study), "http://127.0.0.1:8042", "http://127.0.0.1:8000", ORTHANC,
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
        first = json.loads(driver.stdout.readline() or "{}")
        assert first, driver.stderr.read().decode()[-3000:]
        assert first["sync_status"] == 200 and first["sync_modality"] == "SEG" and first["sync_pixels_sum"] > 0
        assert first["sync_references_series"]
        assert first["unknown_study_status"] == 404
        assert first["job_state"] == "succeeded", first["job_error"]
        assert first["seg_series_in_store"] == 1
        assert first["down_sync_status"] == 502 and first["down_sync_error"] == "dicomweb_unreachable"
        assert "retry" in first["down_job_stage"], first["down_job_stage"]
        orthanc.wait(timeout=30)  # it shut down through its REST API
        orthanc = _ns(netns, ORTHANC, str(orthanc_cfg), stdout=orthanc_log, stderr=subprocess.STDOUT)
        driver.stdin.close()
        second = json.loads(driver.stdout.readline() or "{}")
        assert second.get("retried_job_state") == "succeeded", (second, driver.stderr.read().decode()[-3000:])
    finally:
        for proc in (driver, server, orthanc):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
