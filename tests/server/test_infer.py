"""Synchronous study inference over real HTTP: every input form, both output formats, the bad-input cases,
and the same SEG pixels as apps/bundle_seg."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pydicom
import pytest

from tests.server.conftest import REPO, add_bundle, bundle_snapshot, multipart_files

TUS = {"Tus-Resumable": "1.0.0"}


@pytest.fixture
def demo_server(make_server):
    server = make_server()
    add_bundle(server.config.store, "demo")
    server.store.wait_until("demo", ("loaded",), 60)
    return server


def _seg_pixels(data: bytes) -> np.ndarray:
    return pydicom.dcmread(io.BytesIO(data)).pixel_array


def _zip(folder: Path, extra: dict[str, bytes] | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for path in sorted(folder.iterdir()):
            zf.write(path, f"study/{path.name}")
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return buffer.getvalue()


def test_seg_matches_bundle_seg_app(demo_server, demo_study: Path, tmp_path: Path) -> None:
    """The SEG the server returns for the demo study has the same pixels as the App SDK app's SEG."""
    r = httpx.post(demo_server.url + "/v1/models/demo/infer", files=multipart_files(demo_study), timeout=300)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/dicom"
    served = pydicom.dcmread(io.BytesIO(r.content))
    assert served.Modality == "SEG"
    out = tmp_path / "app_out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(f"ulimit -s 32768; {sys.executable} apps/bundle_seg/app.py -i {demo_study} -o {out} "
                          f"-m {bundle_snapshot()}", shell=True, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    written = pydicom.dcmread(next(out.rglob("*.dcm")))
    assert np.array_equal(served.pixel_array, written.pixel_array)
    assert served.pixel_array.any()
    assert json.loads(r.headers["X-Medserve-Segments"])


def test_zip_upload_reference_and_nifti(demo_server, demo_study: Path, tmp_path: Path) -> None:
    url = demo_server.url
    baseline = httpx.post(url + "/v1/models/demo/infer", files=multipart_files(demo_study), timeout=300)
    archive = _zip(demo_study)
    # (a) zip as one multipart file, and as a raw body
    r = httpx.post(url + "/v1/models/demo/infer", files={"file": ("s.zip", archive, "application/zip")}, timeout=300)
    assert r.status_code == 200, r.text
    assert np.array_equal(_seg_pixels(r.content), _seg_pixels(baseline.content))
    r = httpx.post(url + "/v1/models/demo/infer?format=nifti", content=archive,
                   headers={"Content-Type": "application/zip"}, timeout=300)
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    nifti_path = tmp_path / "labels.nii.gz"
    nifti_path.write_bytes(r.content)
    labels = np.asarray(nib.load(nifti_path).dataobj)
    assert labels.any()
    # (c) a finished tus upload
    created = httpx.post(url + "/v1/uploads", headers={**TUS, "Upload-Length": str(len(archive))})
    location = created.headers["Location"]
    httpx.patch(location, content=archive, headers={**TUS, "Upload-Offset": "0",
                                                    "Content-Type": "application/offset+octet-stream"})
    r = httpx.post(url + "/v1/models/demo/infer", json={"upload": location.rsplit("/", 1)[-1]}, timeout=300)
    assert r.status_code == 200, r.text
    assert np.array_equal(_seg_pixels(r.content), _seg_pixels(baseline.content))
    # (b) a NIfTI file in: the image as NIfTI gives a NIfTI label map (Accept picks the format)
    image = nib.Nifti1Image(np.zeros((24, 24, 12), np.float32) + 40, np.diag([4.0, 4.0, 4.0, 1.0]))
    image_path = tmp_path / "image.nii.gz"
    nib.save(image, image_path)
    r = httpx.post(url + "/v1/models/demo/infer", files={"file": ("image.nii.gz", image_path.read_bytes())},
                   headers={"Accept": "application/x-nifti"}, timeout=300)
    assert r.status_code == 200, r.text
    out = tmp_path / "out.nii.gz"
    out.write_bytes(r.content)
    assert np.asarray(nib.load(out).dataobj).shape == (24, 24, 12)
    r = httpx.post(url + "/v1/models/demo/infer?format=seg", files={"file": ("image.nii.gz", image_path.read_bytes())})
    assert r.status_code == 406


def test_bad_inputs_give_clear_4xx(demo_server, demo_study: Path) -> None:
    url = demo_server.url + "/v1/models/demo/infer"
    files = sorted(demo_study.iterdir())

    def check(response: httpx.Response, status: int, code: str | None = None) -> None:
        assert response.status_code == status, response.text
        body = response.json()
        assert body["message"]
        if code:
            assert body["error"] == code, body

    check(httpx.post(url, files={"f": ("notes.txt", b"hello, not DICOM")}), 400, "not_dicom")
    slip = _zip(demo_study, {"../../evil.dcm": b"x"})
    check(httpx.post(url, content=slip, headers={"Content-Type": "application/zip"}), 400, "zip_slip")
    check(httpx.post(url, content=_zip(demo_study, {"/etc/abs.dcm": b"x"}),
                     headers={"Content-Type": "application/zip"}), 400, "zip_slip")
    truncated = files[0].read_bytes()
    parts = [("files", (p.name, p.read_bytes(), "application/dicom")) for p in files[1:]]
    parts.append(("files", (files[0].name, truncated[: len(truncated) // 2], "application/dicom")))
    r = httpx.post(url, files=parts, timeout=300)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["message"]
    check(httpx.post(demo_server.url + "/v1/models/nope/infer", files=multipart_files(demo_study)), 404,
          "unknown_model")
    check(httpx.post(demo_server.url + "/v1/models/..%2F..%2Fetc/infer", json={"upload": "x"}), 400,
          "bad_model_name")
    check(httpx.post(demo_server.url + "/v1/models/a%5Cb/infer", json={"upload": "x"}), 400, "bad_model_name")
    check(httpx.post(url, json={"upload": "0" * 32}), 404, "unknown_upload")
    check(httpx.post(url, json={"nothing": 1}), 400, "bad_json")
    check(httpx.post(url, content=b"x", headers={"Content-Type": "text/plain"}), 415)
    # the server still serves after all of that
    assert httpx.post(url, files=multipart_files(demo_study), timeout=300).status_code == 200


def test_a_bundle_that_fails_on_the_study_gives_422_inference_failed(make_server, demo_study: Path,
                                                                     tmp_path: Path) -> None:
    """The model loads; its network then refuses the one-channel CT (it expects four): the input's fault."""
    import torch

    from tests.conftest import make_threshold_bundle

    server = make_server()
    staged = make_threshold_bundle(tmp_path / "four_channels")
    config_path = staged / "configs" / "inference.json"
    config = json.loads(config_path.read_text())
    config["network_def"]["in_channels"] = 4
    config_path.write_text(json.dumps(config))
    torch.save(torch.nn.Conv3d(4, 2, 1).state_dict(), staged / "models" / "model.pt")
    add_bundle(server.config.store, "four_channels", staged)
    server.store.wait_until("four_channels", ("loaded",), 60)
    r = httpx.post(server.url + "/v1/models/four_channels/infer", files=multipart_files(demo_study), timeout=300)
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "inference_failed"
    assert "network/inferer (SlidingWindowInferer) failed on the input volume" in r.json()["message"]
    assert server.store.entry("four_channels").state == "loaded"  # the model stays usable for other inputs
