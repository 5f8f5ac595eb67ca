"""Synchronous study inference over real HTTP: every input form, both output formats, the bad-input cases,
and the same SEG pixels as apps/bundle_seg."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import time
import warnings
import zipfile
from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pydicom
import pytest

from medserve.server.dicomweb import DicomWebClient, DicomWebError, split_multipart
from medserve.server.states import FINAL_STATES
from tests.server.conftest import (REPO, FakeDicomWeb, add_bundle, bundle_snapshot, multipart_files, small_study,
                                   with_thr)

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
    nib.save(nib.Nifti1Image(np.full((24, 24, 12), np.nan, np.float32), np.eye(4)), image_path)
    r = httpx.post(url + "/v1/models/demo/infer", files={"file": ("my scan.nii.gz", image_path.read_bytes())})
    assert r.status_code == 400 and r.json()["error"] == "bad_nifti", r.text
    # named as the client named it (the message named the server's staging file, 'input.nii.gz')
    assert r.json()["message"].startswith("my_scan.nii.gz: NIfTI image holds NaN"), r.text


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
    # The file is named as the client sent it; the server's data folder stays out of the message.
    assert r.json()["message"].startswith(f"{files[0].name}: pixel data is truncated"), r.json()
    assert str(demo_server.config.data_dir) not in r.text
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


def test_a_store_sending_a_trickle_is_too_slow_for_a_sync_pull(make_server, tmp_path: Path) -> None:
    """httpx's timeout is per read: a store sending 1 KB a second held the pull, and the request, for its whole
    answer (hours for a real series). After ten windows of the DICOMweb timeout (here 1 s) a retrieve must have
    brought 1 MiB a window on average."""
    with FakeDicomWeb(small_study(tmp_path / "study")) as store:
        store.trickle = 1000  # the study takes 30 s
        server = with_thr(make_server(dicomweb_url=store.url, dicomweb_timeout=1.0))
        started = time.monotonic()
        r = httpx.post(server.url + "/v1/models/thr/infer", json={"study": "1.2.3"}, timeout=25)
        assert (r.status_code, r.json()["error"]) == (504, "dicomweb_timeout"), r.text
        assert re.search(r"is too slow: it sent \d+ bytes in 1\d s of a retrieve \(at least 1048576 per 1 s "
                         r"expected\)", r.json()["message"]), r.text
        assert time.monotonic() - started < 20


def test_a_slow_answer_is_judged_by_its_average_and_one_that_completes_is_kept(tmp_path: Path) -> None:
    """The pace was judged per window on the chunk that ended the answer, before the parser had it: a complete
    study that paused (or an archive that paused, then sent fast) was refused with all its files on disk."""
    client = DicomWebClient("http://127.0.0.1:9/dicom-web", timeout=0.05)  # patience: ten windows, 0.5 s
    body = b"--b\r\nContent-Type: application/dicom\r\n\r\n" + b"x" * 100 + b"\r\n--b--\r\n"

    def pausing(ending: bytes):
        yield body[:40]
        time.sleep(0.6)
        yield ending

    def open_part(headers: dict[str, str]):
        return open(tmp_path / "part.dcm", "wb")

    assert split_multipart(client._paced(pausing(body[40:]), None), b"b", open_part) == 1
    assert (tmp_path / "part.dcm").read_bytes() == b"x" * 100
    with pytest.raises(DicomWebError, match=r"is too slow: it sent 80 bytes in 1 s of a retrieve \(at least "
                                            r"1048576 per 0.05 s expected\)"):
        split_multipart(client._paced(pausing(body[40:80]), None), b"b", open_part)


def test_a_client_gone_during_a_sync_pull_stops_the_pull(make_server, tmp_path: Path) -> None:
    """The pull went on in its thread for as long as the store kept sending (here until the 30 s window gave up)."""
    with FakeDicomWeb(small_study(tmp_path / "study")) as store:
        store.trickle = 1000
        server = with_thr(make_server(dicomweb_url=store.url))
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/models/thr/infer", json={"study": "1.2.3"}, timeout=2)
        assert store.gone_away.wait(10), "the server still reads the store's answer"
        deadline = time.monotonic() + 10  # and the request's folder goes, the pull's files with it
        while any(server.config.tmp_dir.iterdir()):
            assert time.monotonic() < deadline, list(server.config.tmp_dir.rglob("*"))
            time.sleep(0.1)


def test_dicomweb_credentials_in_the_url_are_never_shown(make_server, tmp_path: Path) -> None:
    """A store URL with user:password (how Orthanc's basic auth is given) was echoed in job JSON, 400
    unknown_store and 502 messages, to any client with the infer scope."""
    with FakeDicomWeb(small_study(tmp_path / "study")) as store:
        secret_url = store.url.replace("http://", "http://medserve:s3cret@")
        server = with_thr(make_server(dicomweb_url=secret_url))
        job = httpx.post(server.url + "/v1/jobs?model=thr", json={"study": "1.2.3", "writeback": True}).json()
        wrong = httpx.post(server.url + "/v1/models/thr/infer", json={"study": "1.2.3", "store": "http://other/"})
        same = httpx.post(server.url + "/v1/models/thr/infer", json={"study": "1.2.3", "store": store.url}, timeout=60)
        deadline = time.monotonic() + 60
        while (job := httpx.get(f"{server.url}/v1/jobs/{job['id']}").json())["state"] not in FINAL_STATES:
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
    down = httpx.post(server.url + "/v1/models/thr/infer", json={"study": "1.2.3"}, timeout=60)
    assert job["state"] == "succeeded" and job["writeback_result"]["target"] == store.url, job
    assert (wrong.status_code, wrong.json()["error"]) == (400, "unknown_store"), wrong.text
    assert wrong.json()["message"] == f"this server reads only from {store.url}, not http://other/"
    assert same.status_code == 200, same.text  # named without the credentials, it is the server's store
    assert (down.status_code, down.json()["error"]) == (502, "dicomweb_unreachable"), down.text
    for answer in (json.dumps(job), wrong.text, down.text, httpx.get(server.url + "/v1/jobs").text):
        assert "s3cret" not in answer and "medserve:" not in answer, answer


def test_dicomweb_references_must_be_uids(make_server, tmp_path: Path) -> None:
    """A study/series reference becomes part of the store's URL: anything but a UID is refused before the store
    is contacted, and the client quotes what it puts in a path."""
    with FakeDicomWeb() as store:
        server = with_thr(make_server(dicomweb_url=store.url))
        for body, field in (({"study": "1/../../../system"}, "'study'"),
                            ({"study": "1.2.3", "series": "1.2.3?limit=1&x="}, "'series'"),
                            ({"study": "1." + "2" * 64}, "'study'"), ({"study": "1.2\n"}, "'study'"),
                            ({"study": "1.2", "series": 7}, "'series'")):
            for path in ("/v1/models/thr/infer", "/v1/jobs?model=thr"):
                r = httpx.post(server.url + path, json=body)
                assert r.status_code == 400 and r.json()["error"] == "bad_reference", (body, r.text)
                assert r.json()["message"].startswith(field), r.text
        assert store.paths == []
        with pytest.raises(DicomWebError):
            DicomWebClient(store.url).pull("1.2", "3/../4?x=", tmp_path / "pulled")
        assert store.paths == ["/dicom-web/studies/1.2/series/3%2F..%2F4%3Fx%3D"]


def test_a_store_answering_parts_that_are_not_dicom_is_a_bad_gateway(make_server, tmp_path: Path) -> None:
    """WADO-RS parts labelled as something else, or labelled DICOM without being DICOM (a proxy's error page):
    the store's fault, 502 dicomweb_bad_response naming the part, never the client's 400 bad_dicom."""
    study = small_study(tmp_path / "study", size=16, slices=4)
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "0.html").write_text("<html>502 Bad Gateway</html>")
    with FakeDicomWeb() as store:
        server = with_thr(make_server(dicomweb_url=store.url))
        for source, part_type, problem in (
                (study, "text/html; charset=utf-8", "is 'text/html', not application/dicom"),
                (pages, "application/dicom",
                 "is not a DICOM file (neither the 'DICM' marker at byte 128 nor a dataset at byte 0)")):
            store.study, store.part_type = source, part_type
            r = httpx.post(server.url + "/v1/models/thr/infer", json={"study": "1.2.3"}, timeout=60)
            assert r.status_code == 502 and r.json() == {
                "error": "dicomweb_bad_response",
                "message": f"part 1 of the store's answer for /studies/1.2.3 {problem}"}, r.text


def _patched_zip(archive: bytes, flag_bits: int = 0, method: int | None = None) -> bytes:
    """Sets general-purpose flag bits and/or the compression method in every local and central header."""
    data = bytearray(archive)
    for signature, flags_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        start = data.find(signature)
        while start >= 0:
            data[start + flags_at] |= flag_bits
            if method is not None:
                data[start + flags_at + 2:start + flags_at + 4] = method.to_bytes(2, "little")
            start = data.find(signature, start + 4)
    return bytes(data)


def _raw_request(url: str, head: bytes) -> tuple[int, dict]:
    """One request written byte for byte (header values httpx would refuse to send); returns status and JSON."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(head)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.split(b"\r\n\r\n", 1)[1] or b"{}")


def _deflated_zip(name: str, data: bytes, first_byte: int | None = None) -> bytes:
    """A one-member deflated zip; `first_byte` replaces the first byte of the member's deflate stream."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(name, data)
    archive = bytearray(buffer.getvalue())
    if first_byte is not None:
        name_length, extra_length = int.from_bytes(archive[26:28], "little"), int.from_bytes(archive[28:30], "little")
        archive[30 + name_length + extra_length] = first_byte
    return bytes(archive)


def test_zip_members_that_cannot_be_stored_say_why(tmp_path: Path) -> None:
    """A corrupt deflate stream and an over-long member name are the client's (400 bad_zip, saying which); a
    full disk is the server's (507, not 'damaged')."""
    from medserve.server.errors import ApiError
    from medserve.server.inputs import extract_zip

    def refusal(archive: bytes, dest: Path) -> ApiError:
        (tmp_path / "in.zip").write_bytes(archive)
        with pytest.raises(ApiError) as caught:
            extract_zip(tmp_path / "in.zip", dest, 10**9)
        return caught.value

    # 0x07: final block of the reserved type 3, which zlib rejects ("invalid block type")
    error = refusal(_deflated_zip("IM1.dcm", b"DICM" * 5000, first_byte=0x07), tmp_path / "corrupt")
    assert (error.status, error.code) == (400, "bad_zip") and "'IM1.dcm' is damaged" in error.message, error.message
    long_name = "a" * 300 + ".dcm"
    error = refusal(_deflated_zip(long_name, b"DICM"), tmp_path / "long")
    assert (error.status, error.code) == (400, "bad_zip") and "name too long" in error.message, error.message
    full = tmp_path / "full"
    full.mkdir()
    (full / "IM1.dcm").symlink_to("/dev/full")  # every write there fails with ENOSPC, as on a full disk
    error = refusal(_deflated_zip("IM1.dcm", b"DICM" * 5000), full)
    assert (error.status, error.code) == (507, "insufficient_storage") and error.headers["Retry-After"], error.message


def test_messages_lose_the_servers_folders_at_path_boundaries_only(tmp_path: Path) -> None:
    """A NIfTI part named 'dicom_export.nii.gz', staged beside the 'dicom' folder, was named '._export.nii.gz'."""
    from medserve.server.errors import client_message

    staged = tmp_path / "input"
    message = f"{staged}/dicom_export.nii.gz: bad; {staged}/dicom/IM1.dcm: bad; in {staged}/dicom, {staged}/dicom."
    assert client_message(message, staged / "dicom", staged) == (
        "dicom_export.nii.gz: bad; IM1.dcm: bad; in ., ..")


def test_a_result_the_full_disk_cannot_hold_is_a_507_to_retry(tmp_path: Path) -> None:
    """It was 500 output_failed, a fault of ours, where the client may simply retry later."""
    from medserve.errors import OutputError
    from medserve.server.errors import from_core
    from medserve.writers.files import atomic_output, partial_path

    target = tmp_path / "labels.nii.gz"
    partial_path(target).symlink_to("/dev/full")  # every write there fails with ENOSPC, as on a full disk
    with pytest.raises(OutputError) as caught:
        with atomic_output(target) as partial:
            partial.write_bytes(bytes(65536))
    error = from_core(caught.value, tmp_path)
    assert (error.status, error.code) == (507, "insufficient_storage") and error.headers["Retry-After"], error.message
    assert from_core(OutputError("cannot write seg.dcm: Permission denied")).status == 500  # still ours


def test_damaged_zip_directories_and_gzip_lookalikes_are_the_clients(tmp_path: Path) -> None:
    """A central directory with an offset past its members, a 'version needed' zipfile lacks, or a member name
    flagged UTF-8 that is not: 400 bad_zip, not 500. A body with gzip's magic but no deflate stream is no input."""
    from medserve.server.errors import ApiError
    from medserve.server.inputs import extract_zip, sniff

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("IM0.dcm", b"\0" * 128 + b"DICM" + b"\0" * 64)
    good = buffer.getvalue()
    end, directory = good.rfind(b"PK\x05\x06"), good.find(b"PK\x01\x02")
    bad_offset = bytearray(good)
    struct.pack_into("<I", bad_offset, end + 16, struct.unpack_from("<I", good, end + 16)[0] + 1000)
    new_version = bytearray(good)
    struct.pack_into("<H", new_version, directory + 6, 87)
    bad_name = bytearray(good)
    struct.pack_into("<H", bad_name, directory + 8, struct.unpack_from("<H", good, directory + 8)[0] | 0x800)
    bad_name[directory + 46] = 0xFF  # the first byte of the member's name
    for name, archive in (("offset", bad_offset), ("version", new_version), ("name", bad_name)):
        (tmp_path / f"{name}.zip").write_bytes(archive)
        with pytest.raises(ApiError) as caught:
            extract_zip(tmp_path / f"{name}.zip", tmp_path / name, 10**9)
        assert (caught.value.status, caught.value.code) == (400, "bad_zip"), (name, caught.value.message)
    (tmp_path / "fake.gz").write_bytes(b"\x1f\x8b" + bytes(range(256)) * 2)
    assert sniff(tmp_path / "fake.gz") == "unknown"


def test_malformed_input_fields_give_400_not_500(thr_server, tmp_path: Path) -> None:
    """Zip members that cannot be extracted, fields of the wrong type and numeric headers with non-ASCII digits
    are the client's mistakes: 400 naming the member, field or header."""
    study = small_study(tmp_path / "study", size=16, slices=4)
    url = thr_server.url + "/v1/models/thr/infer"
    archive = _zip(study)
    zip_body = {"Content-Type": "application/zip"}
    for variant, expected in ((_patched_zip(archive, flag_bits=1), "encrypted"),
                              (_patched_zip(archive, method=6), "compression method")):
        r = httpx.post(url, content=variant, headers=zip_body)
        assert r.status_code == 400 and r.json()["error"] == "bad_zip", r.text
        assert "'study/" in r.json()["message"] and expected in r.json()["message"], r.text
    files = sorted(study.iterdir())
    for names in (("a", "a/b"), ("a/b", "a")):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as zf:
            for name, path in zip(names, files):
                zf.writestr(name, path.read_bytes())
        r = httpx.post(url, content=buffer.getvalue(), headers=zip_body)
        assert r.status_code == 400 and r.json()["error"] == "bad_zip", r.text
        assert f"{names[1]!r} clashes" in r.json()["message"], r.text
    r = httpx.post(url, files={"file": ("s.zip", archive)}, data={"format": "bogus"})
    assert r.status_code == 400 and r.json()["error"] == "bad_format"
    r = httpx.post(thr_server.url + "/v1/uploads", headers={**TUS, "Upload-Length": str(len(archive))})
    httpx.patch(r.headers["Location"], content=archive, headers={
        **TUS, "Upload-Offset": "0", "Content-Type": "application/offset+octet-stream"})
    upload = r.headers["Location"].rsplit("/", 1)[-1]
    r = httpx.post(url, json={"upload": upload, "format": ["seg"]})
    assert r.status_code == 400 and r.json()["error"] == "bad_format" and "['seg']" in r.json()["message"]
    r = httpx.post(url, json={"upload": "no-such-upload", "format": 5})  # the format is checked first
    assert r.status_code == 400 and r.json()["error"] == "bad_format", r.text
    r = httpx.post(thr_server.url + "/v1/jobs", json={"upload": upload, "model": 5})
    assert r.status_code == 400 and r.json()["error"] == "bad_model_name" and "5" in r.json()["message"]
    r = httpx.post(url, json={"upload": upload, "writeback": True})  # only a job stores the SEG back
    assert r.status_code == 400 and r.json()["error"] == "bad_parameter" and "POST /v1/jobs" in r.json()["message"]
    r = httpx.post(url, content=b"", headers=zip_body)
    assert r.status_code == 400 and r.json()["error"] == "empty_input", r.text

    for head, header in (
            (b"POST /v1/uploads HTTP/1.1\r\nHost: x\r\nTus-Resumable: 1.0.0\r\nUpload-Length: \xb2\r\n",
             "Upload-Length"),
            (f"PATCH /v1/uploads/{upload} HTTP/1.1\r\nHost: x\r\nTus-Resumable: 1.0.0\r\nContent-Type: "
             "application/offset+octet-stream\r\nUpload-Offset: ".encode() + b"\xb9\r\n", "Upload-Offset"),
            (b"POST /v2/models/thr/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: \xb3\r\n",
             "Inference-Header-Content-Length")):
        status, body = _raw_request(thr_server.url, head + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        assert status == 400 and header in (body.get("message") or body["error"]), body


@pytest.mark.parametrize("accept,media", [("application/dicom;q=0.5, application/gzip", "application/gzip"),
                                          ("application/gzip;q=0, */*", "application/dicom"),
                                          ("application/gzip;q=0.1, application/dicom;q=0.2", "application/dicom")])
def test_the_accept_header_is_read_with_its_q_values(thr_server, tmp_path: Path, accept: str, media: str) -> None:
    study = small_study(tmp_path / "study", size=16, slices=4)
    r = httpx.post(thr_server.url + "/v1/models/thr/infer", files=multipart_files(study), headers={"Accept": accept},
                   timeout=60)
    assert (r.status_code, r.headers["content-type"]) == (200, media), r.text


def test_an_input_of_two_studies_segments_the_first_and_names_the_other(thr_server, tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """As the app does: one volume per request; the study left aside is named in the log, not dropped silently,
    and the response says which study and series the SEG is of."""
    first, second = (small_study(tmp_path / name, size=16, slices=4, seed=k) for k, name in enumerate("ab"))
    uid = {name: pydicom.dcmread(next(folder.iterdir())) for name, folder in (("a", first), ("b", second))}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for folder in (first, second):
            for path in sorted(folder.iterdir()):
                zf.write(path, f"{folder.name}/{path.name}")
    with caplog.at_level(logging.WARNING, logger="medserve.dicom.select"):
        r = httpx.post(thr_server.url + "/v1/models/thr/infer", content=buffer.getvalue(),
                       headers={"Content-Type": "application/zip"})
    assert r.status_code == 200, r.text
    assert r.headers["X-Medserve-Study-UID"] == uid["a"].StudyInstanceUID
    assert (f"1 more selected series not segmented (only the first is): {uid['b'].SeriesInstanceUID} of study "
            f"{uid['b'].StudyInstanceUID}") in caplog.messages
    # A job records it too, for the client that polls it later.
    job = httpx.post(thr_server.url + "/v1/jobs?model=thr", content=buffer.getvalue(),
                     headers={"Content-Type": "application/zip"}).json()
    deadline = time.monotonic() + 60
    while (job := httpx.get(f"{thr_server.url}/v1/jobs/{job['id']}").json())["state"] not in FINAL_STATES:
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    assert job["state"] == "succeeded", job
    assert job["segmented"] == {"study_uid": uid["a"].StudyInstanceUID, "series_uid": uid["a"].SeriesInstanceUID}


def test_request_bodies_over_the_limit_give_413(make_server) -> None:
    """--max-upload-mb holds for multipart, raw and OIP bodies (declared or chunked); JSON references get 1 MiB."""
    server = with_thr(make_server(max_upload_bytes=1_000_000))
    url = server.url + "/v1/models/thr/infer"
    big = os.urandom(1_500_000)

    def chunked(data: bytes):
        for start in range(0, len(data), 100_000):
            yield data[start:start + 100_000]

    multipart = (b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.dcm\"\r\n"
                 b"Content-Type: application/dicom\r\n\r\n" + big + b"\r\n--b--\r\n")
    form = {"Content-Type": "multipart/form-data; boundary=b"}
    for response in (httpx.post(url, files=[("files", ("a.dcm", big, "application/dicom"))]),
                     httpx.post(url, content=chunked(multipart), headers=form),
                     httpx.post(url, content=big, headers={"Content-Type": "application/octet-stream"}),
                     httpx.post(url, content=json.dumps({"upload": "x" * 1_100_000}),
                                headers={"Content-Type": "application/json"}),
                     httpx.post(url, content=chunked(json.dumps({"upload": "x" * 1_100_000}).encode()),
                                headers={"Content-Type": "application/json"})):
        assert response.status_code == 413 and response.json()["error"] == "body_too_large", response.text
    for content in (b"{" + b" " * 1_500_000 + b"}", chunked(b"{" + b" " * 1_500_000 + b"}")):
        r = httpx.post(server.url + "/v2/models/thr/infer", content=content,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "exceeds the limit" in r.json()["error"], r.text
    assert not list(server.config.tmp_dir.iterdir())


def test_every_error_has_the_json_shape(thr_server) -> None:
    """FastAPI's parameter checks and Starlette's routing errors answer {"error", "message"} like ours; a bad
    format is 400 bad_format on every endpoint."""
    url = thr_server.url
    for response, status, code in (
            (httpx.get(url + "/v1/jobs?limit=abc"), 400, "bad_parameter"),
            (httpx.get(url + "/v1/jobs?limit=-1"), 400, "bad_parameter"),
            (httpx.get(url + "/v1/jobs?limit=1001"), 400, "bad_parameter"),
            (httpx.get(url + "/v1/jobs?state=bogus"), 400, "bad_parameter"),
            (httpx.get(url + "/v1/nothing"), 404, "not_found"),
            (httpx.put(url + "/v1/jobs"), 405, "method_not_allowed"),
            (httpx.get(url + "/v1/models/thr/infer"), 405, "method_not_allowed"),
            (httpx.get(url + "/v1/models/thr/unload"), 405, "method_not_allowed"),
            (httpx.get(url + "/v1/jobs/" + "0" * 32 + "/result?format=bogus"), 400, "bad_format")):
        assert response.status_code == status and response.json()["error"] == code, response.text
        assert set(response.json()) == {"error", "message"}
    assert "limit" in httpx.get(url + "/v1/jobs?limit=abc").json()["message"]
    assert "/v1/nothing" in httpx.get(url + "/v1/nothing").json()["message"]
    assert httpx.get(url + "/v1/models/thr/infer").headers["Allow"] == "POST"
    assert httpx.get(url + "/v1/models/thr").json()["name"] == "thr"


def test_deep_json_and_clashing_part_names_are_handled(thr_server, tmp_path: Path) -> None:
    """JSON nested deeper than the parser goes is 400 bad_json, not a bare 500; multipart parts whose names
    clash (twice the same name, and one named like the renamed copy) are all kept."""
    deep = "[" * 100_000 + "]" * 100_000
    for path in ("/v1/models/thr/infer", "/v1/jobs?model=thr"):
        r = httpx.post(thr_server.url + path, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"] == "bad_json", (path, r.text)
    study = small_study(tmp_path / "study", size=16, slices=4)
    names = ["a.dcm", "000002-a.dcm", "a.dcm", "b.dcm"]  # the second is named as the third's renamed copy was
    slices = sorted(study.iterdir())
    files = [("files", (name, path.read_bytes(), "application/dicom")) for name, path in zip(names, slices)]
    r = httpx.post(thr_server.url + "/v1/models/thr/infer", files=files, timeout=120)
    assert r.status_code == 200, r.text  # a lost slice would be a 422 (a series with a missing slice)


def test_names_and_ids_are_checked_whole_and_echoed_short(thr_server) -> None:
    """A trailing newline passed the name patterns ('$' matches before it: 404 instead of 400); a 10,000-character
    name came back whole in the message; `false` as a model was 'missing', `null` as an upload 'no upload None'."""
    url = thr_server.url
    r = httpx.post(url + "/v1/jobs?model=thr%0A", json={"upload": "0" * 32})
    assert r.status_code == 400 and r.json()["error"] == "bad_model_name", r.text
    r = httpx.post(url + "/v1/models/" + "a" * 10_000 + "/infer", json={"upload": "x"})
    assert r.status_code == 400 and r.json()["error"] == "bad_model_name", r.text
    assert r.json()["message"].startswith(f"invalid model name '{'a' * 99}... (10002 characters): start with"), r.text
    r = httpx.get(url + "/v1/jobs/" + "b" * 10_000)
    assert r.status_code == 404 and r.json()["message"] == "no job '" + "b" * 99 + "... (10002 characters)", r.text
    r = httpx.post(url + "/v1/models/thr/infer", json={"upload": "0" * 32 + "\n"})
    assert r.status_code == 404 and r.json()["error"] == "unknown_upload", r.text
    for model in (False, 0):
        r = httpx.post(url + "/v1/jobs", json={"upload": "0" * 32, "model": model})
        assert r.status_code == 400 and r.json()["error"] == "bad_model_name", (model, r.text)
    r = httpx.post(url + "/v1/models/thr/infer", json={"upload": None})
    assert r.status_code == 400 and r.json() == {
        "error": "bad_json", "message": "'upload' must be the id of a tus upload (a string), not None"}, r.text


def test_an_option_given_twice_with_different_values_is_refused(thr_server, tmp_path: Path) -> None:
    """The first or the last value won silently, and the query string over the form: `-F format=seg -F
    format=nifti` gave a label map, `?model=thr` with a form field `model=nope` a job on thr."""
    study = small_study(tmp_path / "study", size=16, slices=4)
    url = thr_server.url
    for path, fields, shown in (
            ("/v1/models/thr/infer", {"format": ["seg", "nifti"]}, "'format' is given more than once, as 'seg' and "
                                                                   "'nifti'; give it once"),
            ("/v1/models/thr/infer?format=nifti", {"format": "seg"}, "'format' is given more than once, as 'nifti' "
                                                                     "and 'seg'; give it once"),
            ("/v1/jobs?model=thr", {"model": "nope"}, "'model' is given more than once, as 'thr' and 'nope'; give "
                                                      "it once")):
        r = httpx.post(url + path, files=multipart_files(study), data=fields, timeout=120)
        assert r.status_code == 400 and r.json() == {"error": "bad_parameter", "message": shown}, (path, r.text)
    r = httpx.post(url + "/v1/models/thr/infer?format=nifti&format=seg", content=_zip(study),
                   headers={"Content-Type": "application/zip"})
    assert r.status_code == 400 and r.json()["error"] == "bad_parameter", r.text
    r = httpx.post(url + "/v1/models/thr/infer?format=nifti", files=multipart_files(study),
                   data={"format": "nifti"}, timeout=120)  # the same value twice says one thing
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip", r.text


def test_fields_the_server_does_not_take_are_refused_not_dropped(thr_server, tmp_path: Path) -> None:
    """A part sent without a filename (curl -F 'files=<PATH') was dropped, and the study segmented one slice
    short with 200; a misspelt option (`fromat`) was ignored; `?model=` naming another model than the path's ran
    the path's; `?writeback=true` beside JSON `true` was a conflict; a job's bad `format` was accepted; a
    gzip-encoded body failed as something else."""
    study = small_study(tmp_path / "study", size=16, slices=4)
    url = thr_server.url
    first = sorted(study.iterdir())[0]
    for path, fields, expected in (
            ("/v1/models/thr/infer", {"files": first.read_bytes().decode("latin-1")},
             "form field 'files' is not a file part (it has no filename) nor one of format, writeback, model"),
            ("/v1/models/thr/infer", {"fromat": "nifti"}, "form field 'fromat' is not a file part"),
            ("/v1/jobs?model=thr", {"fromat": "nifti"}, "form field 'fromat' is not a file part")):
        r = httpx.post(url + path, files=multipart_files(study), data=fields, timeout=120)
        assert r.status_code == 400 and r.json()["error"] == "bad_multipart", (path, r.text)
        assert expected in r.json()["message"], r.text
    r = httpx.post(url + "/v1/models/thr/infer?model=nope", files=multipart_files(study), timeout=120)
    assert r.status_code == 400 and r.json() == {"error": "bad_parameter", "message": "'model' is given as 'nope' "
                                                 "beside the model 'thr' this request is sent to; give it once"}
    r = httpx.post(url + "/v1/models/thr/infer", json={"upload": "0" * 32, "fromat": "nifti"})
    assert r.status_code == 400 and r.json()["error"] == "bad_json" and "unknown field(s) 'fromat'" in r.text
    r = httpx.post(url + "/v1/jobs?model=thr&writeback=true", json={"upload": "0" * 32, "writeback": True})
    assert r.status_code == 404 and r.json()["error"] == "unknown_upload", r.text  # not a 'given twice' conflict
    r = httpx.post(url + "/v1/jobs?model=thr&format=bogus", files=multipart_files(study), timeout=120)
    assert r.status_code == 400 and r.json()["error"] == "bad_format", r.text
    r = httpx.post(url + "/v1/models/thr/infer", content=__import__("gzip").compress(_zip(study)),
                   headers={"Content-Type": "application/zip", "Content-Encoding": "gzip"})
    assert r.status_code == 415 and r.json()["message"].startswith("Content-Encoding 'gzip' is not supported"), r.text
    r = httpx.post(url + "/v1/models/thr/infer", content=b"x", headers={"Content-Type": "multipart/related"})
    assert r.status_code == 415 and "Content-Type 'multipart/related' is not taken" in r.json()["message"], r.text
    r = httpx.post(url + "/v1/models/thr/infer", files=multipart_files(study), timeout=120)
    assert r.status_code == 200, r.text  # the same study in file parts


def test_metrics_count_every_request_with_bounded_labels(thr_server) -> None:
    """404s for unknown models, /v2's own 400s and job submissions were not counted; a name not in the store
    counts under one empty model label, so clients cannot make series without end."""
    url = thr_server.url
    for name in ("nope-1", "nope-2"):
        assert httpx.post(f"{url}/v1/models/{name}/infer", json={"upload": "0" * 32}).status_code == 404
        assert httpx.post(f"{url}/v1/jobs?model={name}", json={"upload": "0" * 32}).status_code == 404
        assert httpx.post(f"{url}/v2/models/{name}/infer", json={"inputs": []}).status_code == 404
    assert httpx.post(f"{url}/v2/models/thr/infer", json={"inputs": []}).status_code == 400
    assert httpx.post(f"{url}/v1/jobs?model=thr", json={"upload": "0" * 32}).status_code == 404
    metrics = httpx.get(url + "/metrics").text
    for line in ('medserve_requests_total{endpoint="v1",model="",status="404"} 2.0',
                 'medserve_requests_total{endpoint="jobs",model="",status="404"} 2.0',
                 'medserve_requests_total{endpoint="v2",model="",status="404"} 2.0',
                 'medserve_requests_total{endpoint="v2",model="thr",status="400"} 1.0',
                 'medserve_requests_total{endpoint="jobs",model="thr",status="404"} 1.0'):
        assert line in metrics, (line, [m for m in metrics.splitlines() if m.startswith("medserve_requests")])
    assert "nope" not in metrics


@pytest.mark.parametrize("kind", ["multipart", "zip"])
def test_a_body_that_stops_arriving_is_given_up_and_its_files_removed(make_server, tmp_path: Path, kind) -> None:
    """uvicorn has no body read timeout: a client whose link dropped without a word held its request, its
    folder of parts and an open file until the server stopped."""
    server = with_thr(make_server(upload_idle_seconds=1.0))
    study = small_study(tmp_path / "study", size=16, slices=4)
    if kind == "multipart":
        body, content_type = _multipart(sorted(study.iterdir())), "multipart/form-data; boundary=XYZ"
    else:
        body, content_type = _zip(study), "application/zip"
    head = (f"POST /v1/models/thr/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=30) as conn:
        conn.sendall(head + body[:len(body) // 2])  # and then nothing, the connection left open
        answer = b""
        while data := conn.recv(65536):  # the whole answer: the server closes the connection after it
            answer += data
    assert answer.startswith(b"HTTP/1.1 408") and b'"error":"body_stalled"' in answer, answer
    assert b"connection: close" in answer.lower(), answer
    deadline = time.monotonic() + 10
    while list(server.config.tmp_dir.iterdir()):
        assert time.monotonic() < deadline, list(server.config.tmp_dir.iterdir())
        time.sleep(0.1)


def test_a_multipart_boundary_over_256_bytes_is_the_clients_error(thr_server, tmp_path: Path) -> None:
    study = small_study(tmp_path / "study", size=16, slices=4)
    boundary = b"B" * 257
    r = httpx.post(thr_server.url + "/v1/models/thr/infer", content=_multipart(sorted(study.iterdir()), boundary),
                   headers={"Content-Type": "multipart/form-data; boundary=" + boundary.decode()})
    assert r.status_code == 400 and r.json()["error"] == "bad_multipart", r.text  # was a 500


def _multipart(paths: list[Path], boundary: bytes = b"XYZ") -> bytes:
    parts = [b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"files\"; filename=\"" + p.name.encode()
             + b"\"\r\nContent-Type: application/dicom\r\n\r\n" + p.read_bytes() + b"\r\n" for p in paths]
    return b"".join(parts) + b"--" + boundary + b"--\r\n"


def test_a_multipart_body_cut_before_its_closing_boundary_is_refused(thr_server, tmp_path: Path) -> None:
    """python-multipart returns the parts it finished: a body cut after some parts (its Content-Length true to
    what was sent) ran on the slices that had arrived, 200 or a succeeded job."""
    study = small_study(tmp_path / "study", size=16, slices=4)
    whole = _multipart(sorted(study.iterdir()))
    headers = {"Content-Type": "multipart/form-data; boundary=XYZ"}
    assert httpx.post(thr_server.url + "/v1/models/thr/infer", content=whole, headers=headers,
                      timeout=120).status_code == 200
    cut_in_a_part = whole[:whole.index(b"--XYZ\r\n", len(whole) // 2) + 300]
    cut_between_parts = whole[:whole.rindex(b"--XYZ--")]
    for body in (cut_in_a_part, cut_between_parts):
        for path in ("/v1/models/thr/infer", "/v1/jobs?model=thr"):
            r = httpx.post(thr_server.url + path, content=body, headers=headers, timeout=120)
            assert r.status_code == 400 and r.json()["error"] == "truncated_body", (path, r.text)
            assert "ends before its closing boundary" in r.json()["message"]
    r = httpx.post(thr_server.url + "/v1/models/thr/infer", content=b"--XYZ--\r\n", headers=headers)
    assert r.status_code == 400 and r.json()["error"] == "empty_input", r.text


def test_zip_members_of_one_path_are_refused_not_overwritten(thr_server, tmp_path: Path) -> None:
    """Every slice stored as 'slice.dcm' ran on the last one alone (200, the other slices lost)."""
    study = small_study(tmp_path / "study", size=16, slices=4)
    buffer = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w") as zf:
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it is asked to write
        for path in sorted(study.iterdir()):
            zf.writestr("study/slice.dcm", path.read_bytes())
        zf.writestr("study/./slice.dcm", b"")  # the same path, spelled otherwise
    r = httpx.post(thr_server.url + "/v1/models/thr/infer", content=buffer.getvalue(),
                   headers={"Content-Type": "application/zip"})
    assert r.status_code == 400 and r.json() == {
        "error": "bad_zip", "message": "zip member 'study/slice.dcm' has the path of an earlier member "
                                       "('study/slice.dcm'); expected each file once"}, r.text


def test_a_retrieve_that_breaks_off_closes_the_instance_being_written(tmp_path: Path) -> None:
    """WADO-RS parts are streamed to files; when the stream breaks off mid-instance (the store drops the
    connection) the file being written is closed, not left open for the garbage collector."""
    import httpx as http

    from medserve.server.dicomweb import split_multipart

    opened: list = []

    def open_part(headers: dict[str, str]):  # noqa: ANN202
        opened.append(open(tmp_path / f"{len(opened)}.dcm", "wb"))
        return opened[-1]

    def chunks():  # noqa: ANN202
        yield b"--b\r\nContent-Type: application/dicom\r\n\r\n" + b"x" * 100 + b"\r\n--b\r\n\r\n" + b"y" * 50
        raise http.ReadError("connection reset by the store")

    with pytest.raises(http.ReadError):
        split_multipart(chunks(), b"b", open_part)
    assert len(opened) == 2 and all(handle.closed for handle in opened)
    assert (tmp_path / "0.dcm").read_bytes() == b"x" * 100


def test_files_without_the_dicom_preamble_are_accepted_as_the_app_accepts_them(thr_server, tmp_path: Path) -> None:
    study = small_study(tmp_path / "study", size=16, slices=4)
    files = multipart_files(study)
    name, (filename, content, content_type) = files[1]
    files[1] = (name, (filename, content[132:], content_type))  # no preamble, no "DICM": starts at group 0002
    r = httpx.post(thr_server.url + "/v1/models/thr/infer", files=files, timeout=120)
    assert r.status_code == 200, r.text  # all four slices: one left out would be a 422 (a missing slice)


_XML_REFUSAL = """<?xml version="1.0" encoding="UTF-8"?>
<NativeDicomModel>
  <DicomAttribute tag="00081198" vr="SQ" keyword="FailedSOPSequence">
    <Item number="1">
      <DicomAttribute tag="00081150" vr="UI"><Value number="1">1.2</Value></DicomAttribute>
      <DicomAttribute tag="00081197" vr="US" keyword="FailureReason"><Value number="1">42752</Value></DicomAttribute>
    </Item>
  </DicomAttribute>
</NativeDicomModel>"""


@pytest.mark.parametrize("status,answer,problem", [
    (202, _XML_REFUSAL, "STOW-RS answered 202 but the store refused 1 of 1 instances (failure reasons: 0xA700 "
                        "(out of resources))"),
    (202, "<html>proxy says hi</html", "STOW-RS answered 202 (some instances not stored) with an answer that is "
                                       "neither DICOM JSON nor XML"),
    (200, {"00081198": {"vr": "SQ", "Value": [{"00081197": "garbled"}]}},
     "STOW-RS answered 200 but the store refused 1 of 1 instances (failure reasons: unknown)"),
], ids=["xml-refusal", "unreadable-202", "malformed-reason"])
def test_stow_answers_in_other_shapes_are_read_for_refusals(tmp_path: Path, status, answer, problem) -> None:
    seg = next(iter(sorted(small_study(tmp_path / "study", size=16, slices=2).iterdir())))
    with FakeDicomWeb() as store:
        store.stow_answer = (status, answer)
        with pytest.raises(DicomWebError) as raised:
            DicomWebClient(store.url, 10).store([seg])
    assert raised.value.code == "dicomweb_store_refused" and raised.value.message.startswith(problem), \
        raised.value.message


def test_a_wado_answer_cut_short_is_a_truncated_answer_not_an_unreachable_store(tmp_path: Path) -> None:
    study = small_study(tmp_path / "study", size=16, slices=4)
    with FakeDicomWeb(study) as store:
        store.cut_get = True
        with pytest.raises(DicomWebError) as raised:
            DicomWebClient(store.url, 10).pull("1.2", None, tmp_path / "pulled")
    assert raised.value.code == "dicomweb_truncated" and raised.value.retryable, raised.value.message
    assert "its answer during retrieve ended early" in raised.value.message


def test_an_empty_stow_answer_is_success(tmp_path: Path) -> None:
    seg = next(iter(sorted(small_study(tmp_path / "study", size=16, slices=2).iterdir())))
    with FakeDicomWeb() as store:
        store.stow_answer = (200, "")
        assert DicomWebClient(store.url, 10).store([seg]) == {}
        assert store.stow_framing == ["length"]  # not chunked: an intermediary dropped a chunked body


def test_a_stow_answer_that_does_not_list_the_instance_sent_is_a_refusal(tmp_path: Path) -> None:
    """Orthanc answers 200 with an empty Referenced SOP Sequence to a body that lost its parts on the way: the
    write-back was recorded as done, the job as succeeded, with nothing in the store."""
    seg = next(iter(sorted(small_study(tmp_path / "study", size=16, slices=2).iterdir())))
    uid = pydicom.dcmread(seg).SOPInstanceUID
    with FakeDicomWeb() as store:
        store.stow_answer = (200, {"00081199": {"vr": "SQ"}})
        with pytest.raises(DicomWebError) as raised:
            DicomWebClient(store.url, 10).store([seg])
        assert raised.value.code == "dicomweb_store_refused" and not raised.value.retryable
        assert raised.value.message == (f"STOW-RS answered 200 but its ReferencedSOPSequence does not list 1 of the 1 "
                                        f"instances sent ({seg.name}): the store did not keep them")
        listed = {"00081199": {"vr": "SQ", "Value": [{"00081155": {"vr": "UI", "Value": [uid]}}]}}
        store.stow_answer = (200, listed)
        assert DicomWebClient(store.url, 10).store([seg]) == listed
        item = f'<Item number="1"><DicomAttribute tag="00081155" vr="UI"><Value number="1">{uid}</Value>' \
               '</DicomAttribute></Item>'
        for items, stored in (("", False), (item, True)):  # the same read from a DICOM XML answer
            store.stow_answer = (200, f'<NativeDicomModel><DicomAttribute tag="00081199" vr="SQ">{items}'
                                      '</DicomAttribute></NativeDicomModel>')
            if stored:
                assert DicomWebClient(store.url, 10).store([seg]) == listed
            else:
                with pytest.raises(DicomWebError, match="ReferencedSOPSequence does not list 1 of the 1"):
                    DicomWebClient(store.url, 10).store([seg])


def test_an_unforeseen_failure_is_a_json_500_without_internals(thr_server, monkeypatch: pytest.MonkeyPatch) -> None:
    from medserve.server.store import ModelEntry

    def fail(self: ModelEntry) -> dict:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(ModelEntry, "summary", fail)
    r = httpx.get(thr_server.url + "/v1/models/thr")
    assert r.status_code == 500 and r.json()["error"] == "internal_error", r.text
    assert "RuntimeError" in r.json()["message"] and "secret" not in r.text
    v2 = httpx.get(thr_server.url + "/v2/models/thr/versions/1/ready")  # another route still answers
    assert v2.status_code == 404 and "not '1'" in v2.json()["error"]
