"""tus 1.0.0 at /v1/uploads, exercised with the real tuspy client and with raw requests for the error cases."""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from tusclient import client as tus
from tusclient.storage.filestorage import FileStorage

from medserve.server.errors import ApiError
from medserve.server.uploads import WRITE_BATCH, UploadStore
from tests.server.conftest import ServerProcess, add_bundle, free_port

TUS = {"Tus-Resumable": "1.0.0"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _upload_file(server, upload_id: str) -> Path:
    return server.config.uploads_dir / f"{upload_id}.bin"


def test_options_advertises_extensions(make_server) -> None:
    server = make_server()
    r = httpx.options(server.url + "/v1/uploads")
    assert r.status_code == 204
    assert set(r.headers["Tus-Extension"].split(",")) >= {"creation", "termination", "expiration", "checksum"}
    assert "sha1" in r.headers["Tus-Checksum-Algorithm"]


def test_tuspy_upload_cut_and_resume(make_server, tmp_path: Path) -> None:
    server = make_server()
    data = tmp_path / "blob.bin"
    data.write_bytes(os.urandom(5 * 1024 * 1024 + 123))
    storage = FileStorage(str(tmp_path / "urls.json"))
    client = tus.TusClient(server.url + "/v1/uploads")
    first = client.uploader(str(data), chunk_size=1024 * 1024, store_url=True, url_storage=storage,
                            upload_checksum=True)
    first.upload(stop_at=2 * 1024 * 1024)
    upload_url = first.url
    assert first.offset == 2 * 1024 * 1024

    # The client dies in the middle of a PATCH: it has sent 1.5 MiB of a 3 MiB chunk when its connection ends.
    # It ends with a FIN, so everything sent reaches the server (a reset could drop what the server had not yet
    # read, and what the server keeps would depend on timing).
    sent = 1536 * 1024
    path = "/" + upload_url.split("/", 3)[3]
    head = (f"PATCH {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nTus-Resumable: 1.0.0\r\n"
            f"Upload-Offset: {first.offset}\r\nContent-Type: application/offset+octet-stream\r\n"
            f"Content-Length: {3 * 1024 * 1024}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=10) as conn:
        conn.sendall(head + data.read_bytes()[first.offset:first.offset + sent])
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(65536):  # until the server has given up on the request and closed
            pass
    # What arrived before the cut is kept (no checksum on that request): all of it, but for what uvicorn had
    # read from the socket and not yet passed on when it saw the connection end (its buffer, well under 1.5 MiB).
    upload_id = upload_url.rsplit("/", 1)[-1]
    deadline = time.monotonic() + 10
    while server.app.state.services.uploads.busy(upload_id):  # the PATCH handler is still saving what it got
        assert time.monotonic() < deadline, "the cut PATCH never ended"
        time.sleep(0.05)
    offset = int(httpx.head(upload_url, headers=TUS).headers["Upload-Offset"])
    assert first.offset + sent // 2 < offset <= first.offset + sent, offset

    # A new uploader (a new process, say) finds the URL in its storage, asks the offset and finishes.
    resumed = client.uploader(str(data), chunk_size=1024 * 1024, store_url=True, url_storage=storage,
                              upload_checksum=True)
    assert resumed.url == upload_url and resumed.offset == offset
    resumed.upload()
    assert _sha256(_upload_file(server, upload_id)) == _sha256(data)
    info = httpx.get(upload_url).json()
    assert info["complete"] and info["length"] == data.stat().st_size


def _create(server, length: int, **headers: str) -> str:
    r = httpx.post(server.url + "/v1/uploads", headers={**TUS, "Upload-Length": str(length),
                                                       "Upload-Metadata": "filename " +
                                                       base64.b64encode(b"x.zip").decode(), **headers})
    assert r.status_code == 201, r.text
    assert r.headers["Upload-Expires"]
    return r.headers["Location"]


def _patch(url: str, data: bytes, offset: int, **headers: str) -> httpx.Response:
    return httpx.patch(url, content=data, headers={**TUS, "Upload-Offset": str(offset),
                                                   "Content-Type": "application/offset+octet-stream", **headers})


def test_a_crash_in_the_middle_of_a_checksummed_patch_keeps_none_of_its_bytes(tmp_path: Path,
                                                                             store_dir: Path) -> None:
    """kill -9 while a checksummed PATCH streams: its bytes were never verified, so after a restart the offset is
    where it was before that PATCH, and the client resends the chunk from there."""
    data_dir = tmp_path / "data"
    args = ["--store", str(store_dir), "--data-dir", str(data_dir), "--device", "cpu"]
    server = ServerProcess(args, free_port()).start()
    body = os.urandom(3 * WRITE_BATCH)
    checksum = "sha1 " + base64.b64encode(hashlib.sha1(body).digest()).decode()
    try:
        location = _create(server, len(body))
        upload_id = location.rsplit("/", 1)[-1]
        head = (f"PATCH /v1/uploads/{upload_id} HTTP/1.1\r\nHost: 127.0.0.1\r\nTus-Resumable: 1.0.0\r\n"
                f"Upload-Offset: 0\r\nContent-Type: application/offset+octet-stream\r\n"
                f"Upload-Checksum: {checksum}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(head + body[:len(body) - WRITE_BATCH // 2])
            deadline = time.monotonic() + 30
            while sum(p.stat().st_size for p in (data_dir / "uploads").glob(f"{upload_id}.*")
                      if p.suffix != ".json") < 2 * WRITE_BATCH:  # the server has written two batches
                assert time.monotonic() < deadline, "the server never wrote the PATCH's first batches"
                time.sleep(0.05)
            server.kill()
    finally:
        server.kill()
    restarted = ServerProcess(args, server.port).start()
    try:
        assert httpx.head(location, headers=TUS).headers["Upload-Offset"] == "0"
        assert not list((data_dir / "uploads").glob("*.pending"))
        resent = _patch(location, body, 0, **{"Upload-Checksum": checksum})
        assert (resent.status_code, resent.headers["Upload-Offset"]) == (204, str(len(body))), resent.text
        assert (data_dir / "uploads" / f"{upload_id}.bin").read_bytes() == body
    finally:
        restarted.stop()


@pytest.mark.parametrize("checksummed", [False, True])
def test_a_stopping_server_answers_the_patch_in_progress(tmp_path: Path, store_dir: Path, checksummed: bool) -> None:
    """SIGTERM while a PATCH's body was still coming: after the 5 s grace period uvicorn cancelled it into a
    plain-text 500 and logged a CancelledError traceback. The PATCH now ends at once with a 503 that says where to
    resume (what arrived is kept; a checksummed chunk, unverified, is dropped) and the server stops cleanly."""
    data_dir = tmp_path / "data"
    args = ["--store", str(store_dir), "--data-dir", str(data_dir), "--device", "cpu"]
    server = ServerProcess(args, free_port()).start()
    body = os.urandom(1000)
    extra = f"Upload-Checksum: sha1 {base64.b64encode(hashlib.sha1(body).digest()).decode()}\r\n" if checksummed else ""
    try:
        location = _create(server, len(body))
        head = (f"PATCH /v1/uploads/{location.rsplit('/', 1)[-1]} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Tus-Resumable: 1.0.0\r\nUpload-Offset: 0\r\nContent-Type: application/offset+octet-stream\r\n"
                f"{extra}Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as quiet:
            quiet.sendall(head + body[:100])  # and then nothing more, the connection left open
            time.sleep(1.0)  # the server is reading the body
            server.proc.terminate()
            started = time.monotonic()
            answer = b""
            while b"}" not in answer:
                data = quiet.recv(65536)
                assert data, answer
                answer += data
        assert time.monotonic() - started < 3, "the PATCH waited for the grace period"
        kept = 0 if checksummed else 100
        assert answer.startswith(b"HTTP/1.1 503") and b"server_stopping" in answer, answer
        assert f"upload-offset: {kept}\r\n".encode() in answer.lower() and b"retry-after: 5" in answer.lower()
        server.proc.wait(timeout=20)
        log = server.proc.stdout.read().decode()
        assert "Traceback" not in log and "CancelledError" not in log, log
    finally:
        server.kill()
    restarted = ServerProcess(args, server.port).start()
    try:
        assert httpx.head(location, headers=TUS).headers["Upload-Offset"] == str(kept)
        resumed = _patch(location, body[kept:], kept)
        assert (resumed.status_code, resumed.headers["Upload-Offset"]) == (204, "1000"), resumed.text
    finally:
        restarted.stop()


def test_metadata_comes_back_as_sent(make_server) -> None:
    """HEAD echoes Upload-Metadata: a key without a value (tus 1.0.0 allows it) and a value that is not UTF-8
    come back as the client sent them; the JSON view shows text where there is text."""
    server = make_server()
    sent = "filename " + base64.b64encode("étude.zip".encode()).decode() + ",is_confidential,raw //4="
    r = httpx.post(server.url + "/v1/uploads", headers={**TUS, "Upload-Length": "4", "Upload-Metadata": sent})
    assert r.status_code == 201, r.text
    head = httpx.head(r.headers["Location"], headers=TUS)
    assert head.status_code == 200 and head.headers["Upload-Metadata"] == sent
    assert httpx.get(r.headers["Location"]).json()["metadata"] == {"filename": "étude.zip", "is_confidential": "",
                                                                   "raw": "//4="}


def test_protocol_errors(make_server) -> None:
    server = make_server(max_upload_bytes=1000)
    url = _create(server, 10)
    # wrong offset -> 409, missing Tus-Resumable -> 412, wrong content type -> 415, unknown upload -> 404; each
    # with Tus-Resumable, as tus asks of every response (the errors had none)
    not_tus = {"Upload-Offset": "0", "Content-Type": "application/offset+octet-stream"}
    for response, status in ((_patch(url, b"abc", 5), 409),
                             (httpx.patch(url, content=b"a", headers=not_tus), 412),
                             (httpx.patch(url, content=b"a", headers={**TUS, "Upload-Offset": "0"}), 415),
                             (httpx.head(server.url + "/v1/uploads/" + "0" * 32, headers=TUS), 404),
                             (httpx.delete(server.url + "/v1/uploads/nope", headers=TUS), 404)):
        assert (response.status_code, response.headers.get("Tus-Resumable")) == (status, "1.0.0"), response
    # a digest of the wrong size (none, as a bare 'sha1') -> 400 before the body is read, not 460 after it
    for header, size in (("sha1", 0), ("sha1 " + base64.b64encode(b"short").decode(), 5)):
        r = _patch(url, b"hello", 0, **{"Upload-Checksum": header})
        assert r.status_code == 400 and r.json() == {
            "error": "bad_checksum", "message": f"Upload-Checksum needs 'ALGORITHM BASE64-DIGEST' with the 20-byte "
                                                f"sha1 digest; got {size} byte(s)"}, r.text
    # checksum mismatch -> 460 and nothing kept; correct checksum -> 204
    bad = "sha1 " + base64.b64encode(hashlib.sha1(b"other").digest()).decode()
    r = _patch(url, b"hello", 0, **{"Upload-Checksum": bad})
    assert r.status_code == 460 and r.json()["error"] == "checksum_mismatch"
    assert httpx.head(url, headers=TUS).headers["Upload-Offset"] == "0"
    good = "sha1 " + base64.b64encode(hashlib.sha1(b"hello").digest()).decode()
    r = _patch(url, b"hello", 0, **{"Upload-Checksum": good})
    assert r.status_code == 204 and r.headers["Upload-Offset"] == "5"
    # more bytes than declared -> 413, offset unchanged
    r = _patch(url, b"0123456789", 5)
    assert r.status_code == 413 and r.json()["error"] == "upload_too_long"
    assert httpx.head(url, headers=TUS).headers["Upload-Offset"] == "5"
    # declared length over the limit -> 413 at creation
    r = httpx.post(server.url + "/v1/uploads", headers={**TUS, "Upload-Length": "1001"})
    assert r.status_code == 413
    # an incomplete upload cannot be used as an input
    add_bundle(server.config.store, "m")
    server.store.wait_until("m", ("loaded",), 30)
    r = httpx.post(server.url + "/v1/models/m/infer", json={"upload": url.rsplit("/", 1)[-1]})
    assert r.status_code == 409 and r.json()["error"] == "upload_incomplete"
    # termination
    assert httpx.delete(url, headers=TUS).status_code == 204
    assert httpx.head(url, headers=TUS).status_code == 404


def test_a_405_allows_every_method_of_its_path(make_server) -> None:
    """Routing named only the first route matching the path: Allow: OPTIONS on an upload that also takes HEAD,
    GET, PATCH and DELETE (RFC 9110: the 405's Allow lists the target's methods)."""
    server = make_server()
    url = _create(server, 6)
    for response, allowed in ((httpx.post(url, headers=TUS), "DELETE, GET, HEAD, OPTIONS, PATCH"),
                              (httpx.put(server.url + "/v1/uploads", headers=TUS), "OPTIONS, POST"),
                              (httpx.put(server.url + "/v1/jobs/abc"), "DELETE, GET"),
                              (httpx.put(server.url + "/v1/models/x/load"), "POST"),  # not GET: not a model name
                              (httpx.get(server.url + "/v1/models/x/infer"), "POST"),
                              (httpx.put(server.url + "/v1/models/x"), "GET"),
                              (httpx.post(server.url + "/openapi.json"), "GET, HEAD")):
        assert (response.status_code, response.headers.get("Allow")) == (405, allowed), response.text


def test_protocol_details_other_clients_rely_on(make_server) -> None:
    """X-HTTP-Method-Override (tus: MUST be taken as the method) was a 405; Tus-Resumable was missing from
    routing's answers; a Content-Type in capitals was 415; duplicate or non-ASCII metadata keys were accepted;
    integer headers over 4,300 digits were a 500 (int() refuses them)."""
    server = make_server()
    url = _create(server, 6)
    override = {**TUS, "X-HTTP-Method-Override": "PATCH", "Upload-Offset": "0",
                "Content-Type": "application/offset+octet-stream"}
    r = httpx.post(url, content=b"abc", headers=override)
    assert (r.status_code, r.headers["Upload-Offset"], r.headers["Tus-Resumable"]) == (204, "3", "1.0.0"), r.text
    r = _patch(url, b"def", 3, **{"Content-Type": "Application/Offset+Octet-Stream"})
    assert (r.status_code, r.headers["Upload-Offset"]) == (204, "6"), r.text
    for response, status in ((httpx.get(server.url + "/v1/uploads", headers=TUS), 405),
                             (httpx.post(url, headers=TUS), 405),
                             (httpx.head(url + "/extra", headers=TUS), 404),
                             (httpx.post(server.url + "/v1/uploads", headers={"Upload-Length": "1"}), 412)):
        assert (response.status_code, response.headers.get("Tus-Resumable")) == (status, "1.0.0"), response
    assert "Tus-Resumable" not in httpx.get(server.url + "/healthz").headers
    assert httpx.post(url, headers={**TUS, "X-HTTP-Method-Override": "DELETE"}).status_code == 204
    assert httpx.head(url, headers=TUS).status_code == 404
    for metadata, message in (("a YQ==,a Yg==", "Upload-Metadata names the key 'a' twice"),
                              ("é YQ==".encode().decode("latin-1"), "keys are printable ASCII")):
        r = httpx.post(server.url + "/v1/uploads", headers={**TUS, "Upload-Length": "1",
                                                            "Upload-Metadata": metadata.encode("latin-1")})
        assert r.status_code == 400 and r.json()["error"] == "bad_metadata" and message in r.json()["message"], r.text
    huge = "9" * 5000
    r = httpx.post(server.url + "/v1/uploads", headers={**TUS, "Upload-Length": huge})
    assert r.status_code == 400 and r.json()["error"] == "bad_upload_length", r.text
    r = _patch(_create(server, 4), b"a", 0, **{"Upload-Offset": huge})
    assert r.status_code == 400 and r.json()["error"] == "bad_upload_offset", r.text[:300]


@pytest.mark.parametrize("checksummed", [False, True])
def test_a_patch_whose_body_stalls_ends_and_frees_the_upload(make_server, checksummed: bool) -> None:
    """A client whose link dropped without a word (no FIN, no RST) left its PATCH waiting for the rest of the
    body for good: every resume, DELETE and the expiry got 423 upload_locked. Now it ends after
    upload_idle_seconds with 408, keeping what arrived (a checksummed chunk: nothing), and the upload resumes."""
    server = make_server(upload_idle_seconds=1.0)
    url = _create(server, 1000)
    path = "/" + url.split("/", 3)[3]
    checksum = ("Upload-Checksum: sha1 " + base64.b64encode(hashlib.sha1(bytes(1000)).digest()).decode() + "\r\n"
                if checksummed else "")
    head = (f"PATCH {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nTus-Resumable: 1.0.0\r\nUpload-Offset: 0\r\n"
            f"Content-Type: application/offset+octet-stream\r\n{checksum}Content-Length: 1000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=30) as conn:
        conn.sendall(head + bytes(100))  # and then nothing more, the connection left open
        started = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = conn.recv(65536)
            assert data, answer  # closed without an answer
            answer += data
        waited = time.monotonic() - started
    status_line, *header_lines = answer.split(b"\r\n\r\n")[0].decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    kept = "0" if checksummed else "100"
    assert status_line.startswith("HTTP/1.1 408") and headers["upload-offset"] == kept, answer
    assert headers["tus-resumable"] == "1.0.0" and headers["connection"] == "close" and waited < 10, headers
    assert httpx.head(url, headers=TUS).headers["Upload-Offset"] == kept
    r = _patch(url, bytes(1000 - int(kept)), int(kept))
    assert (r.status_code, r.headers["Upload-Offset"]) == (204, "1000"), r.text


@pytest.mark.parametrize("method", ["PATCH", "DELETE"])
def test_a_resume_takes_over_an_upload_whose_patch_went_quiet(make_server, method: str) -> None:
    """A client whose link dropped without a word left its PATCH holding the upload until the idle timeout (a
    minute): its resume, or a DELETE, got 423 meanwhile, and tus-js-client gives up after 9 s. The new request
    now asks the quiet PATCH to end, as tusd does; that PATCH ends 409 upload_interrupted, keeping what arrived."""
    server = make_server(upload_idle_seconds=60.0)
    url = _create(server, 1000)
    path = "/" + url.split("/", 3)[3]
    head = (f"PATCH {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nTus-Resumable: 1.0.0\r\nUpload-Offset: 0\r\n"
            f"Content-Type: application/offset+octet-stream\r\nContent-Length: 1000\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=30) as quiet:
        quiet.sendall(head + bytes(100))  # and then nothing more, the connection left open
        deadline = time.monotonic() + 10
        while not server.app.state.services.uploads.busy(url.rsplit("/", 1)[-1]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        started = time.monotonic()
        if method == "PATCH":  # the resume's HEAD said 0: the quiet PATCH's 100 bytes were not on disk yet
            r = _patch(url, bytes(1000), 0)
            assert (r.status_code, r.headers["Upload-Offset"]) == (409, "100"), r.text  # kept: resume from there
            r = _patch(url, bytes(900), 100)
            assert (r.status_code, r.headers["Upload-Offset"]) == (204, "1000"), r.text
        else:
            r = httpx.delete(url, headers=TUS)
            assert r.status_code == 204, r.text
        assert time.monotonic() - started < 5
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = quiet.recv(65536)
            assert data, answer
            answer += data
    assert answer.startswith(b"HTTP/1.1 409") and b"upload_interrupted" in answer, answer
    assert b"upload-offset: 100" in answer.lower(), answer


def test_expiration(make_server) -> None:
    server = make_server(upload_expiry_seconds=0.5)
    url = _create(server, 4)
    time.sleep(0.8)
    gone = httpx.head(url, headers=TUS)
    assert (gone.status_code, gone.headers.get("Cache-Control")) == (410, "no-store")  # a HEAD's error too
    assert not list(server.config.uploads_dir.glob("*.bin"))


def test_a_patch_running_past_the_expiry_keeps_the_upload(make_server) -> None:
    """Expiry and the sweep leave an upload alone while a PATCH writes it (the PATCH renews it); an upload whose
    bytes vanished answers 404, and is not renewed."""
    server = make_server(upload_expiry_seconds=1.0)
    uploads = server.app.state.services.uploads
    url = _create(server, 6)

    def slow_body():
        for _ in range(6):
            yield b"x"
            time.sleep(0.4)

    result: dict[str, httpx.Response] = {}
    writer = threading.Thread(target=lambda: result.setdefault("patch", _patch(url, slow_body(), 0)))
    writer.start()
    time.sleep(1.6)  # past the expiry, mid-PATCH
    assert httpx.head(url, headers=TUS).status_code == 200
    assert uploads.sweep() == 0
    writer.join(timeout=30)
    assert result["patch"].status_code == 204 and result["patch"].headers["Upload-Offset"] == "6"
    assert httpx.head(url, headers=TUS).headers["Upload-Offset"] == "6"
    assert httpx.get(url).json()["complete"]

    other = _create(server, 4).rsplit("/", 1)[-1]
    info = uploads.info(other)
    _upload_file(server, other).unlink()
    assert httpx.head(f"{server.url}/v1/uploads/{other}", headers=TUS).status_code == 404
    assert httpx.get(f"{server.url}/v1/uploads/{other}").json()["error"] == "unknown_upload"
    with pytest.raises(ApiError) as refused:
        uploads.touch(info)
    assert refused.value.status == 404


def test_an_upload_being_written_is_not_handed_to_inference(tmp_path: Path) -> None:
    store = UploadStore(tmp_path, max_bytes=1024, expiry_seconds=60)
    info = store.create(4)
    store._paths(info.id)[0].write_bytes(b"DICM")  # complete, but a PATCH may still roll its last bytes back

    async def while_patching() -> None:
        async with store.writing(info.id):
            with pytest.raises(ApiError) as raised:
                store.finished(info.id)
            assert (raised.value.status, raised.value.code) == (409, "upload_in_progress")

    asyncio.run(while_patching())
    assert store.finished(info.id) == store._paths(info.id)[0]


def test_only_existing_uploads_get_a_lock_and_deleted_ones_drop_it(make_server) -> None:
    server = make_server()
    uploads = server.app.state.services.uploads
    for _ in range(3):
        r = httpx.patch(f"{server.url}/v1/uploads/{os.urandom(16).hex()}", content=b"x",
                        headers={**TUS, "Upload-Offset": "0", "Content-Type": "application/offset+octet-stream"})
        assert r.status_code == 404, r.text
    created = httpx.post(server.url + "/v1/uploads", headers={**TUS, "Upload-Length": "1"})
    location = created.headers["Location"]
    headers = {**TUS, "Upload-Offset": "0", "Content-Type": "application/offset+octet-stream"}
    assert httpx.patch(location, content=b"x", headers=headers).status_code == 204
    assert len(uploads._locks) == 1
    assert httpx.delete(location, headers=TUS).status_code == 204
    assert uploads._locks == {}


@pytest.mark.parametrize("endpoint", ["/v1/models/thr/infer", "/v1/jobs"])
def test_an_upload_removed_while_it_is_staged_is_a_404(thr_server, demo_study: Path, endpoint: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A tus DELETE (or the expiry sweep) that removes a finished upload between the request's check of it and
    the copy of its bytes into the request: 404 unknown_upload, as if it had come a moment earlier."""
    data = next(p for p in sorted(demo_study.iterdir()) if p.is_file()).read_bytes()
    location = _create(thr_server, len(data))
    assert _patch(location, data, 0).status_code == 204
    uploads = thr_server.app.state.services.uploads
    finished = UploadStore.finished

    def finished_then_deleted(store: UploadStore, upload_id: str) -> Path:
        path = finished(store, upload_id)
        store.delete(upload_id)  # what a concurrent DELETE /v1/uploads/ID does
        return path

    monkeypatch.setattr(UploadStore, "finished", finished_then_deleted)
    r = httpx.post(thr_server.url + endpoint, json={"upload": location.rsplit("/", 1)[-1], "model": "thr"},
                   timeout=60)
    assert (r.status_code, r.json()["error"]) == (404, "unknown_upload"), r.text
    assert "removed" in r.json()["message"], r.text
    assert list(uploads.root.iterdir()) == []


def test_a_failed_create_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills up while an upload is created leaves neither bytes nor a description behind."""
    store = UploadStore(tmp_path, max_bytes=1024, expiry_seconds=60)

    def disk_full(path: Path, *args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError):
        store.create(4)
    assert list(tmp_path.iterdir()) == []


def test_sweep_removes_what_a_crash_left_once_it_is_older_than_the_expiry(tmp_path: Path) -> None:
    store = UploadStore(tmp_path, max_bytes=1024, expiry_seconds=60)
    kept = store.create(4)
    old = time.time() - 120
    leftovers = [tmp_path / f"{'1' * 32}.bin", tmp_path / f"{'2' * 32}.json.tmp"]
    recent = [tmp_path / f"{'3' * 32}.bin", tmp_path / f"{'4' * 32}.json.tmp"]  # a create still in progress
    for path in leftovers + recent:
        path.write_bytes(b"x")
    for path in [*leftovers, *store._paths(kept.id)]:
        os.utime(path, (old, old))  # the live upload's files are as old; its description keeps them
    assert store.sweep() == 0
    assert sorted(tmp_path.iterdir()) == sorted([*recent, *store._paths(kept.id)])


def test_a_start_drops_what_a_cut_checksummed_patch_wrote_and_nothing_else(tmp_path: Path) -> None:
    store = UploadStore(tmp_path, max_bytes=1024, expiry_seconds=60)
    cut, unstarted = store.create(16), store.create(16)
    for info in (cut, unstarted):
        store._paths(info.id)[0].write_bytes(b"verified" + b"unverified"[:8])
    store.pending_path(cut.id).write_text("8")  # the PATCH started at offset 8
    store.pending_path(unstarted.id).write_text("")  # the crash came while the marker was being written
    UploadStore(tmp_path, max_bytes=1024, expiry_seconds=60)
    assert store._paths(cut.id)[0].read_bytes() == b"verified"
    assert store._paths(unstarted.id)[0].read_bytes() == b"verified" + b"unverified"[:8]
    assert not list(tmp_path.glob("*.pending"))


def test_a_full_disk_under_a_patch_is_a_507_with_retry_after_and_tus_resumable(make_server) -> None:
    """The server's disk full while a chunk is stored: the client can retry later (it was a 500 without the
    header tus clients check)."""
    server = make_server()
    url = _create(server, 10)
    data = _upload_file(server, url.rsplit("/", 1)[-1])
    data.unlink()
    data.symlink_to("/dev/full")  # every write there fails with ENOSPC, as on a full disk
    response = _patch(url, b"0123456789", 0)
    assert (response.status_code, response.headers.get("Tus-Resumable"), response.headers.get("Retry-After")) == (
        507, "1.0.0", "60"), response.text
    assert response.json() == {"error": "insufficient_storage",
                               "message": "the server has no room left for this upload chunk; retry later"}
    assert response.headers["Upload-Offset"] == "0"  # where to resume (409, 413 and 460 said it; 507 did not)


def test_a_checksummed_chunk_cut_by_the_servers_stop_is_dropped_at_once(tmp_path: Path) -> None:
    """A stopping server cancels a PATCH still running after its grace period. The roll-back of a checksummed
    chunk awaited in the cancelled task, so it was cancelled too: the unverified bytes stayed until the next
    start."""
    import anyio

    from medserve.server.uploads import _receive_verified

    class StalledBody:  # one batch arrives, then nothing, until the stop
        offset, length, ended = 3, 3 + 2 * WRITE_BATCH, "complete"

        async def chunks(self):
            yield bytes(WRITE_BATCH)
            await anyio.sleep(60)

    data, pending = tmp_path / "up.bin", tmp_path / "up.pending"
    data.write_bytes(b"abc")

    async def stop_during_the_body() -> None:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                async def stop() -> None:
                    while data.stat().st_size == 3:  # until the batch is on disk
                        await anyio.sleep(0.01)
                    scope.cancel()

                group.start_soon(stop)
                await _receive_verified(StalledBody(), data, pending, (hashlib.sha256(), bytes(32)))

    anyio.run(stop_during_the_body)
    assert data.read_bytes() == b"abc" and not pending.exists()


async def _quiet_patch(store: UploadStore, upload_id: str, name: str, ended: dict[str, str]) -> None:
    """A PATCH of one byte, then nothing: `ended[name]` says how its body ended."""
    from medserve.server.uploads import Body

    async with store.writing(upload_id) as interrupt:
        body = Body(_body_request(b"x"), 0, 1000, 60, interrupt)
        async for _ in body.chunks():
            pass
        ended[name] = body.ended


def _body_request(*chunks: bytes, more: bool = True) -> Any:
    """A Starlette request whose body is `chunks`, then (with `more`) nothing: a link gone quiet."""
    from starlette.requests import Request

    messages: asyncio.Queue = asyncio.Queue()
    for index, chunk in enumerate(chunks):
        messages.put_nowait({"type": "http.request", "body": chunk,
                             "more_body": more or index < len(chunks) - 1})
    return Request({"type": "http", "method": "PATCH", "headers": [], "path": "/"}, messages.get)


def test_takeovers_and_stops_end_quiet_patches_only_and_each_holder_in_turn(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """From the review of the takeover: a request queued behind another waiter never asked the next holder to
    end (423 after the wait); a PATCH whose whole body had arrived, asked during its last disk write, was dropped
    as taken over; a request that came while a first one's ask was expiring the holder's wait failed with
    RuntimeError (a 500). From the review of the stop: stop_writers asked only the PATCHes holding an upload
    then, so a resume waiting for one took it next and read on until the grace period cut it off."""
    from medserve.server import uploads as uploads_module
    from medserve.server.uploads import Body, _receive_verified

    monkeypatch.setattr(uploads_module, "TAKEOVER_POLL_SECONDS", 0.1)
    store = UploadStore(tmp_path, max_bytes=10**6, expiry_seconds=60)
    info = store.create(1000)

    async def queued_in_turn() -> dict:
        ended: dict[str, str] = {}
        first = asyncio.create_task(_quiet_patch(store, info.id, "first", ended))
        await asyncio.sleep(0.05)
        # a resume whose link goes quiet too, and one that came while the first still held the upload
        second = asyncio.create_task(_quiet_patch(store, info.id, "second", ended))
        third = asyncio.create_task(_quiet_patch(store, info.id, "third", ended))
        await asyncio.sleep(1.0)
        holds = store.busy(info.id)
        for task in (first, second, third):
            task.cancel()
        await asyncio.gather(first, second, third, return_exceptions=True)
        return {**ended, "third holds": holds}

    assert asyncio.run(queued_in_turn()) == {"first": "taken over", "second": "taken over", "third holds": True}

    other = store.create(1000).id  # an asyncio lock belongs to one event loop

    async def racing_an_expiring_ask() -> dict:
        ended: dict[str, str] = {}
        holder = asyncio.create_task(_quiet_patch(store, other, "holder", ended))
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()

        async def taker(name: str) -> None:
            async with store.writing(other):
                ended[name] = "took it"

        def one_then_another() -> None:  # the second's step lands after the first ask's expiry, before the holder
            loop.create_task(taker("one"))
            loop.call_soon(lambda: loop.create_task(taker("another")))

        loop.call_soon(one_then_another)
        await asyncio.sleep(0.5)
        await holder
        return ended

    assert asyncio.run(racing_an_expiring_ask()) == {"holder": "taken over", "one": "took it", "another": "took it"}

    monkeypatch.setattr(uploads_module, "WRITE_BATCH", 150)
    whole = store.create(200)
    data = store._paths(whole.id)[0]

    async def asked_during_the_last_write() -> tuple:
        request = _body_request(b"a" * 100, b"b" * 100, more=False)

        async def holder() -> tuple:
            async with store.writing(whole.id) as interrupt:
                body = Body(request, 0, 200, 60, interrupt)
                kept = await _receive_verified(body, data, store.pending_path(whole.id),
                                               (hashlib.sha1(), hashlib.sha1(b"a" * 100 + b"b" * 100).digest()))
                return body.ended, kept

        writing = asyncio.create_task(holder())
        for _ in range(20):  # until the whole body has been read, and the holder writes it
            await asyncio.sleep(0)

        async def taker() -> int:
            async with store.writing(whole.id):
                return store.offset(whole.id)

        return await writing, await asyncio.create_task(taker())

    assert asyncio.run(asked_during_the_last_write()) == (("complete", 200), 200)

    stopped = store.create(1000).id

    async def stopping() -> dict:
        ended: dict[str, str] = {}
        holder = asyncio.create_task(_quiet_patch(store, stopped, "holder", ended))
        await asyncio.sleep(0.05)
        resume = asyncio.create_task(_quiet_patch(store, stopped, "resume", ended))
        await asyncio.sleep(0)  # the resume is waiting for the upload, having asked the holder to end
        store.stop_writers()
        await asyncio.wait_for(asyncio.gather(holder, resume), 5)
        return ended

    assert asyncio.run(stopping()) == {"holder": "taken over", "resume": "server stopping"}
