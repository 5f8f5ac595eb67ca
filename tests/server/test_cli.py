"""The CLI client against a real server: `medserve infer` (tus upload, resume, job, download), tables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydicom
import pytest
from tusclient import client as tus

from medserve.net import http_url
from medserve.server.client import UploadKey, UploadUrls, study_zip
from tests.conftest import run_unprivileged
from tests.server.conftest import REPO, add_bundle


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medserve.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


def test_infer_resumes_upload_and_tables(make_server, demo_study: Path, tmp_path: Path) -> None:
    server = make_server()
    add_bundle(server.config.store, "demo")
    server.store.wait_until("demo", ("loaded",), 60)
    env = {**os.environ, "MEDSERVE_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    # An earlier run was interrupted after 300 kB of the study's upload (same cache, same zip bytes).
    os.environ["MEDSERVE_CACHE"] = env["MEDSERVE_CACHE"]
    try:
        archive = study_zip(demo_study)
    finally:
        del os.environ["MEDSERVE_CACHE"]
    storage = UploadUrls(Path(env["MEDSERVE_CACHE"]) / "tus-uploads.json")
    partial = tus.TusClient(server.url + "/v1/uploads").uploader(
        str(archive), chunk_size=100_000, store_url=True, url_storage=storage, metadata={"filename": archive.name},
        fingerprinter=UploadKey(server.url, archive))
    partial.upload(stop_at=300_000)
    partial_id = partial.url.rsplit("/", 1)[-1]
    sent = archive.read_bytes()

    out = tmp_path / "out"
    proc = _cli("infer", "demo", str(demo_study), "-o", str(out), "--url", server.url, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seg = pydicom.dcmread(out / "seg.dcm")
    assert seg.Modality == "SEG" and seg.pixel_array.any()
    # The upload that finished is the one started before: resumed, not re-sent from zero.
    uploads = sorted(p.stem for p in server.config.uploads_dir.glob("*.bin"))
    assert uploads == [partial_id], uploads
    assert (server.config.uploads_dir / f"{partial_id}.bin").read_bytes() == sent
    assert not archive.exists()  # with the result downloaded, the cached zip is not kept

    models = _cli("models", "--url", server.url, env=env)
    assert models.returncode == 0 and "demo" in models.stdout and "loaded" in models.stdout
    jobs = _cli("jobs", "--url", server.url, env=env)
    assert jobs.returncode == 0 and "succeeded" in jobs.stdout
    listed = __import__("httpx").get(server.url + "/v1/jobs").json()["jobs"]
    job = _cli("job", listed[0]["id"], "--url", server.url, env=env)
    assert job.returncode == 0 and listed[0]["id"] in job.stdout and "total_s" in job.stdout
    assert listed[0]["segmented"]["series_uid"] in job.stdout
    # Into a pipe, without COLUMNS, the tables keep their values whole (rich cut them to 'suc…' at 80 columns).
    piped = {key: value for key, value in env.items() if key != "COLUMNS"}
    jobs = _cli("jobs", "--url", server.url, env=piped)
    assert jobs.returncode == 0 and listed[0]["id"] in jobs.stdout and "succeeded" in jobs.stdout, jobs.stdout
    missing = _cli("infer", "nope", str(demo_study), "-o", str(out), "--url", server.url, env=env)
    assert missing.returncode == 2 and "nope" in missing.stderr


def test_infer_checks_what_it_can_before_the_upload(make_server, tmp_path: Path) -> None:
    """An unknown model, an output place that cannot take the result and flags that do not go with a STUDY_DIR
    are refused before the study goes up (a bad -o was a traceback after the whole job; --writeback was dropped
    silently); job ids stay one path segment; a bad --url or --token is one error line, not a traceback."""
    from tests.server.conftest import small_study

    server = make_server()
    add_bundle(server.config.store, "demo")
    server.store.wait_until("demo", ("loaded",), 60)
    study = small_study(tmp_path / "study", size=16, slices=4)
    env = {**os.environ, "MEDSERVE_CACHE": str(tmp_path / "cache")}
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "seg.dcm").mkdir()
    (tmp_path / "a-file").write_text("x")
    url = ["--url", server.url]
    for args, expected in (
            (["infer", "nope", str(study), "-o", str(tmp_path / "o1"), *url], "server answered 404: no model 'nope'"),
            (["infer", "demo", str(study), "-o", str(tmp_path / "a-file"), *url],
             f"output folder {tmp_path / 'a-file'} is a file; expected a folder"),
            (["infer", "demo", str(study), "-o", str(tmp_path / "taken"), *url],
             f"{tmp_path / 'taken' / 'seg.dcm'} is a folder; expected the result's file name to be free"),
            (["infer", "demo", str(study), "--writeback", "--series", "1.2", *url],
             "--series, --writeback: for a study in the DICOM store (--study UID); with a STUDY_DIR to upload, "
             "give none of them"),
            (["infer", "demo", str(tmp_path / "absent"), "-o", str(tmp_path / "o1"), *url],
             f"{tmp_path / 'absent'} does not exist; expected the folder of the study's DICOM files"),
            (["job", "../models", *url], "server answered 404: Not Found: GET /v1/jobs/../models"),  # not /models
            (["job", "", *url], "empty job id; expected one that `medserve jobs` lists"),
            (["models", "--url", "http://[::1"], "--url 'http://[::1' is not a URL"),
            (["models", "--url", "localhost:8000"], "--url 'localhost:8000': expected http://HOST:PORT"),
            (["models", "--token", "t\u00f6ken", *url], "--token holds characters an HTTP header cannot carry")):
        proc = _cli(*args, env=env)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"error: {expected}"), (
            args, proc.stderr[-2000:])
    assert not list(server.config.uploads_dir.glob("*.bin"))  # nothing went up
    assert not (tmp_path / "o1").exists()  # the output folder made for the refused run is gone again


def test_serve_refuses_public_address_without_tokens(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "medserve.cli", "serve", "--host", "0.0.0.0", "--store",
                           str(tmp_path), "--data-dir", str(tmp_path / "d")], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != "MEDSERVE_TOKENS"})
    assert proc.returncode == 2 and "--insecure" in proc.stderr


def test_serve_refuses_a_port_or_data_dir_it_cannot_use_in_one_line(tmp_path: Path) -> None:
    """--port 70000 was an OverflowError, a data dir it could not make a traceback, a port in use uvicorn's own
    message after 'serving' (exit 3); a store that does not exist is made, with a warning."""
    (tmp_path / "a-file").write_text("x")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    store = ["--store", str(tmp_path / "store")]
    try:
        for args, expected in (
                (["--port", "70000"], "medserve serve: error: argument --port: expected a TCP port, 0 to 65535, not "
                                      "70000"),
                (["--data-dir", str(tmp_path / "a-file")], f"error: data dir {tmp_path / 'a-file'} is a file; "
                                                           "expected a folder"),
                (["--data-dir", str(tmp_path / "a-file" / "d")], f"error: data dir {tmp_path / 'a-file' / 'd'}: "
                                                                 "cannot be created (Not a directory)"),
                (["--port", port, "--data-dir", str(tmp_path / "d")],
                 f"error: cannot listen on 127.0.0.1:{port} (Address already in use)")):
            proc = _cli("serve", *store, *args, env=dict(os.environ))
            assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(expected), (
                args, proc.stderr[-2000:])
            assert "Traceback" not in proc.stderr
    finally:
        taken.close()
    assert f"store {tmp_path / 'store'} does not exist; it is created empty" in proc.stderr


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--max-memory-mb", "0", "argument --max-memory-mb: expected more than 0, not 0"),
    ("--max-models", "0", "argument --max-models: expected at least 1, not 0"),
    ("--concurrency", "two", "argument --concurrency: expected an integer, not 'two'"),
    ("--poll-interval", "-1", "argument --poll-interval: expected at least 0.0, not -1"),
])
def test_serve_refuses_limits_that_cannot_be_meant(tmp_path: Path, flag: str, value: str, expected: str) -> None:
    """0 (or less) would otherwise have read as 'no limit' (--max-memory-mb 0) or have stalled the server."""
    proc = _cli("serve", "--store", str(tmp_path), flag, value, env=dict(os.environ))
    assert proc.returncode == 2 and expected in proc.stderr, proc.stderr


@pytest.mark.parametrize(("tokens_text", "env_tokens", "expected"), [
    (None, "", "tokens file {tokens}: cannot be read (No such file or directory)"),
    ("only-a-token\n", "", "{tokens}:1: expected 'TOKEN SCOPE[,SCOPE]'"),
    ("", "tok:superuser", "MEDSERVE_TOKENS: scopes must be among ('infer', 'admin'), got 'superuser'"),
    ("", ":admin", "MEDSERVE_TOKENS: an entry has an empty token (':admin'); expected 'TOKEN:SCOPE[,SCOPE]' "
                   "entries separated by ';'"),
])
def test_serve_refuses_unusable_tokens_with_one_error_line(tmp_path: Path, tokens_text, env_tokens, expected) -> None:
    """An empty token (`$UNSET:admin`) would grant admin to a blank bearer token: refused like the others."""
    tokens = tmp_path / "tokens"
    if tokens_text is not None:
        tokens.write_text(tokens_text)
    proc = _cli("serve", "--store", str(tmp_path), "--data-dir", str(tmp_path / "d"), "--tokens", str(tokens),
                env={**os.environ, "MEDSERVE_TOKENS": env_tokens})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"error: {expected.format(tokens=tokens)}", proc.stderr


def test_tokens_and_scopes(make_server, tmp_path: Path) -> None:
    import httpx

    tokens = tmp_path / "tokens"
    tokens.write_text("# token scopes\nuser-token infer\nadmin-token admin\n")
    server = make_server(tokens_file=tokens)
    url = server.url
    assert httpx.get(url + "/healthz").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer user-token"}).status_code == 403
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer admin-token"}).status_code == 200
    assert httpx.get(url + "/v1/jobs", headers={"Authorization": "Bearer user-token"}).status_code == 200
    assert httpx.get(url + "/v1/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url + "/v1/jobs", headers={"Authorization": "Bearer \u00a0".encode("latin-1")}).status_code == 401
    r = httpx.post(url + "/v1/uploads", headers={"Tus-Resumable": "1.0.0", "Upload-Length": "1"})
    assert r.status_code == 401 and r.json()["error"] == "unauthorized"
    # Under /v2 errors take the Open Inference Protocol's shape, auth and routing errors included.
    for response, status, text in ((httpx.post(url + "/v2/models/x/infer", json={}), 401, "missing bearer token"),
                                   (httpx.get(url + "/v2/nothing"), 404, "/v2/nothing")):
        assert response.status_code == status and set(response.json()) == {"error"}, response.text
        assert text in response.json()["error"], response.text


def test_infer_reruns_find_the_right_upload_and_job(thr_server, tmp_path: Path) -> None:
    """`medserve infer` re-runs: another study of the same size and first 64 KB is uploaded anew (not taken for
    the first); an upload the server has dropped is started again; a job that failed is run again once the
    bundle is fixed, instead of being replayed; files that are not DICOM stay out of the upload."""
    import httpx
    import numpy as np

    from tests.server.conftest import small_study

    url = thr_server.url
    env = {**os.environ, "MEDSERVE_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}

    def infer(model: str, study: Path, out: str) -> subprocess.CompletedProcess:
        return _cli("infer", model, str(study), "-o", str(tmp_path / out), "--url", url, env=env)

    first = small_study(tmp_path / "first", size=16, slices=6)
    assert infer("thr", first, "out1").returncode == 0
    # The same study with other pixels in its last slice: same file sizes, same first 64 KB of the zip.
    second = tmp_path / "second"
    second.mkdir()
    for path in sorted(first.iterdir()):
        (second / path.name).write_bytes(path.read_bytes())
    last = sorted(second.iterdir())[-1]
    dataset = pydicom.dcmread(last)
    dataset.PixelData = (np.frombuffer(dataset.PixelData, np.int16) + 500).astype(np.int16).tobytes()
    dataset.save_as(last)
    assert last.stat().st_size == (first / last.name).stat().st_size
    (second / "README.txt").write_text("a CD's leaflet, not DICOM")
    run = infer("thr", second, "out2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "leaving out 1 files that are not DICOM: README.txt" in run.stderr
    jobs = httpx.get(url + "/v1/jobs").json()["jobs"]
    assert len(jobs) == 2 and len(list(thr_server.config.uploads_dir.glob("*.bin"))) == 2
    assert (tmp_path / "out1" / "seg.dcm").read_bytes() != (tmp_path / "out2" / "seg.dcm").read_bytes()

    # The server has dropped the uploads (expired, or deleted): a re-run uploads the study again.
    for upload in thr_server.config.uploads_dir.glob("*.bin"):
        httpx.delete(f"{url}/v1/uploads/{upload.stem}", headers={"Tus-Resumable": "1.0.0"})
    run = infer("thr", first, "out3")
    assert run.returncode == 0, run.stderr[-3000:]

    # A bundle without weights: the job fails. Once the weights are there, the re-run runs a new job.
    broken = thr_server.config.store / "late"
    for part in ("configs", "models"):
        (broken / part).mkdir(parents=True)
        for path in (thr_server.config.store / "thr" / part).iterdir():
            if path.name != "model.pt":
                (broken / part / path.name).write_bytes(path.read_bytes())
    thr_server.store.wait_until("late", ("failed",), 30)
    run = infer("late", first, "out4")
    assert run.returncode != 0 and "failed" in run.stderr, run.stderr[-3000:]
    (broken / "models" / "model.pt").write_bytes((thr_server.config.store / "thr" / "models" / "model.pt").read_bytes())
    thr_server.store.wait_until("late", ("loaded", "available"), 30)
    run = infer("late", first, "out4")
    assert run.returncode == 0, run.stderr[-3000:]
    states = sorted(j["state"] for j in httpx.get(url + "/v1/jobs").json()["jobs"] if j["model"] == "late")
    assert states == ["failed", "succeeded"], states


def test_infer_takes_options_before_the_study_and_jobs_shows_whole_ids(thr_server, tmp_path: Path) -> None:
    """`medserve infer NAME -o OUT STUDY` (an option between the positionals) runs; the jobs table keeps each job
    id whole on a narrow terminal, since that is what `medserve job ID` takes."""
    from tests.server.conftest import small_study

    env = {**os.environ, "MEDSERVE_CACHE": str(tmp_path / "cache"), "COLUMNS": "60"}
    study = small_study(tmp_path / "study", size=16, slices=4)
    run = _cli("infer", "thr", "-o", str(tmp_path / "out"), str(study), "--url", thr_server.url, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert pydicom.dcmread(tmp_path / "out" / "seg.dcm").Modality == "SEG"
    jobs = _cli("jobs", "--url", thr_server.url, env=env)
    job_id = __import__("httpx").get(thr_server.url + "/v1/jobs").json()["jobs"][0]["id"]
    assert jobs.returncode == 0 and job_id in jobs.stdout, jobs.stdout


def test_client_commands_say_in_one_line_that_the_server_is_down(tmp_path: Path) -> None:
    from tests.server.conftest import free_port, small_study

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {**os.environ, "MEDSERVE_CACHE": str(tmp_path / "cache")}
    study = small_study(tmp_path / "study", size=16, slices=4)
    for args in (("job", "0" * 32, "--cancel"), ("job", "0" * 32), ("jobs",), ("infer", "thr", str(study)),
                 ("infer", "thr", "--study", "1.2.3")):
        proc = _cli(*args, "--url", url, env=env)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr[-3000:])
        assert last.startswith(f"error: cannot reach the medserve server at {url}: "), (args, last)
        assert "Connection refused" in last and not last.endswith("None"), (args, last)


def test_the_study_zip_holds_what_the_app_reads(tmp_path: Path, monkeypatch) -> None:
    """`medserve infer` zipped with rglob: slices behind a link to a folder were left out (the app follows such
    links) and an unreadable folder was skipped; either way a part of the study was segmented as the whole."""
    from medserve.demo.phantom import make_phantom
    from medserve.demo.study import write_ct_series

    written = write_ct_series(make_phantom(shape=(6, 16, 16), seed=1).hu, tmp_path / "elsewhere")
    study = tmp_path / "study"
    study.mkdir()
    for path in written.paths[:3]:
        path.rename(study / path.name)
    (study / "more").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    monkeypatch.setenv("MEDSERVE_CACHE", str(tmp_path / "cache"))
    with __import__("zipfile").ZipFile(study_zip(study)) as archive:
        assert sorted(archive.namelist()) == sorted([p.name for p in written.paths[:3]]
                                                    + [f"more/{p.name}" for p in written.paths[3:]])
    (tmp_path / "elsewhere").chmod(0)
    try:
        result = run_unprivileged("import sys; from medserve.server.client import study_zip; study_zip("
                                  "__import__('pathlib').Path(sys.argv[1]))", study)
    finally:
        (tmp_path / "elsewhere").chmod(0o755)
    assert result.returncode == 1 and (f"ClientError: {study / 'more'}: folder cannot be read (Permission denied)"
                                       in result.stderr), result.stderr


def test_the_client_cache_is_checked_and_an_empty_setting_is_unset(tmp_path: Path, monkeypatch) -> None:
    """MEDSERVE_CACHE on a file was a traceback; an empty one put zips/ and tus-urls.json in the current folder."""
    from medserve.server.client import ClientError, cache_dir

    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("MEDSERVE_CACHE", str(tmp_path / "a-file"))
    with pytest.raises(ClientError, match=rf"^cache folder {tmp_path / 'a-file'} \(MEDSERVE_CACHE\): cannot be "
                                          r"created \(File exists\)"):
        cache_dir()
    monkeypatch.setenv("MEDSERVE_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert cache_dir() == tmp_path / "home" / ".cache" / "medserve"


def _answering_server(status: int, body: bytes, content_type: str, port: int = 0) -> Any:
    """An HTTP server on 127.0.0.1 that answers every GET with `body` (not started: call serve_forever)."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)


@pytest.mark.parametrize(("status", "body", "expected"), [
    (404, b"<html>\n<body>\n<h1>Not Found</h1>\n" + b"<p>padding</p>\n" * 200 + b"</body></html>",
     "server answered 404: <html> <body> <h1>Not Found</h1> <p>padding</p>"),
    (400, b"[1, 2]", "server answered 400: [1, 2]"),  # JSON, but not medserve's shape: was an AttributeError
    (200, b"plain text", "answered 200 with no JSON (text/html); is http://127.0.0.1:"),  # was a JSONDecodeError
])
def test_a_server_that_is_not_medserve_is_one_short_error_line(status: int, body: bytes, expected: str) -> None:
    import threading

    server = _answering_server(status, body, "text/html")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = _cli("models", "--url", f"http://127.0.0.1:{server.server_address[1]}", env=dict(os.environ))
    finally:
        server.shutdown()
        server.server_close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and len(lines[0]) < 300, proc.stderr[-1000:]
    assert expected in lines[0], lines


def test_infer_runs_a_study_again_when_its_replayed_job_lost_its_result(thr_server, tmp_path: Path) -> None:
    """A re-run found the job it had started (Idempotency-Key) but the server no longer had its result (410):
    every re-run then failed the same way. Now the study runs again, once."""
    import shutil

    import httpx

    from tests.server.conftest import small_study

    env = {**os.environ, "MEDSERVE_CACHE": str(tmp_path / "cache")}
    study = small_study(tmp_path / "study", size=16, slices=4)
    first = _cli("infer", "thr", str(study), "-o", str(tmp_path / "out1"), "--url", thr_server.url, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    [job] = httpx.get(thr_server.url + "/v1/jobs").json()["jobs"]
    shutil.rmtree(thr_server.config.jobs_dir / job["id"])
    again = _cli("infer", "thr", str(study), "-o", str(tmp_path / "out2"), "--url", thr_server.url, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"job {job['id']}'s result is gone from the server; running the study again"
            in " ".join(again.stderr.split()))
    assert (tmp_path / "out2" / "seg.dcm").read_bytes()[128:132] == b"DICM"
    assert len(httpx.get(thr_server.url + "/v1/jobs").json()["jobs"]) == 2


def test_the_study_zip_cache_tells_apart_studies_with_equal_names_sizes_and_times(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """The cached zip was found by file names, sizes and mtimes alone: a copy made with `cp -p` (or unpacked
    from an archive with fixed timestamps) whose pixels differ got the first study's zip, so its job segmented
    the other study, exit 0. An edit in place that keeps the mtime likewise."""
    import shutil
    import zipfile

    from tests.server.conftest import small_study

    monkeypatch.setenv("MEDSERVE_CACHE", str(tmp_path / "cache"))
    first = small_study(tmp_path / "first", size=16, slices=4)
    second = tmp_path / "second"
    shutil.copytree(first, second)  # copy2: mtimes kept
    edited = sorted(second.iterdir())[-1]
    dataset = pydicom.dcmread(edited)
    dataset.PixelData = bytes(len(dataset.PixelData))
    dataset.save_as(edited)
    for study in (first, second):
        for path in study.iterdir():
            os.utime(path, ns=(0, 315532800 * 10**9))  # 1980-01-01, as zips unpack
    assert [p.stat().st_size for p in sorted(first.iterdir())] == [p.stat().st_size for p in sorted(second.iterdir())]

    def zipped(study: Path) -> bytes:
        with zipfile.ZipFile(study_zip(study)) as archive:
            return archive.read(edited.name)

    assert zipped(first) == (first / edited.name).read_bytes()
    assert zipped(second) == edited.read_bytes() != (first / edited.name).read_bytes()
    (first / edited.name).write_bytes(edited.read_bytes())  # same size; the mtime set back
    os.utime(first / edited.name, ns=(0, 315532800 * 10**9))
    assert zipped(first) == edited.read_bytes()
    assert not list((tmp_path / "cache" / "zips").glob("*.partial"))


def test_upload_urls_survive_parallel_runs_and_a_damaged_file(tmp_path: Path, caplog) -> None:
    """tuspy's FileStorage (TinyDB) neither locks nor writes atomically: parallel `medserve infer` runs left
    tus-urls.json damaged, and every later run was a JSONDecodeError traceback."""
    script = ("import sys; from pathlib import Path; from medserve.server.client import UploadUrls\n"
              "urls = UploadUrls(Path(sys.argv[1]))\n"
              "for i in range(40):\n"
              "    urls.set_item(f'{sys.argv[2]}-{i}', f'http://x/{i}')\n"
              "    urls.remove_item(f'{sys.argv[2]}-{i - 1}') if i % 2 else None\n")
    path = tmp_path / "tus-uploads.json"
    writers = [subprocess.Popen([sys.executable, "-c", script, str(path), f"w{n}"], cwd=REPO) for n in range(6)]
    assert [writer.wait(timeout=120) for writer in writers] == [0] * 6
    stored = __import__("json").loads(path.read_text())
    assert len(stored) == 6 * 20 and stored["w3-39"] == "http://x/39"
    path.write_text('{"a": "http://x/1"}   }')  # what the interleaved TinyDB writes left
    urls = UploadUrls(path)
    assert urls.get_item("a") is None
    assert "cannot be read" in caplog.text and "earlier uploads will start again" in caplog.text
    urls.set_item("b", "http://x/2")
    assert UploadUrls(path).get_item("b") == "http://x/2"


def test_infer_errors_of_the_upload_and_names_are_one_plain_line(make_server, tmp_path: Path) -> None:
    """A refused upload was tuspy's text with a Python bytes repr ("... status 413: b'{"error":...}'"); a model
    name '..' reached the server as GET /v1 (the URL lost it) and was answered 'Not Found'."""
    from tests.server.conftest import small_study

    server = make_server(max_upload_bytes=1_000)
    add_bundle(server.config.store, "demo")
    server.store.wait_until("demo", ("loaded",), 60)
    env = {**os.environ, "MEDSERVE_CACHE": str(tmp_path / "cache")}
    study = small_study(tmp_path / "study", size=16, slices=4)
    too_large = _cli("infer", "demo", str(study), "-o", str(tmp_path / "out"), "--url", server.url, env=env)
    last = too_large.stderr.strip().splitlines()[-1]
    assert too_large.returncode == 2 and last.startswith("error: upload failed: server answered 413: Upload-Length "), (
        too_large.stderr[-2000:])
    assert "b'" not in last
    dots = _cli("infer", "..", str(study), "--url", server.url, env=env)
    assert dots.returncode == 2 and dots.stderr.strip().splitlines()[-1] == (
        "error: invalid model name '..': start with a letter or digit, then use letters, digits, '.', '_' or '-' "
        "(at most 128 in all), no '..' and no path separators")


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_client_commands_end_on_sigterm_as_on_ctrl_c(tmp_path: Path, signal_name: str) -> None:
    """SIGTERM/SIGHUP (a closed terminal, a dropped SSH session) killed `medserve infer` outright: the output
    folder it made, a partial download or zip stayed. Now they end it as Ctrl-C does: one error line, exit
    128 + N, its clean-up done (here: the output folder made for a request the server never answers)."""
    import signal
    import threading
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    out = tmp_path / "made" / "out"
    proc = subprocess.Popen([sys.executable, "-m", "medserve.cli", "infer", "demo", "--study", "1.2.3", "-o",
                             str(out), "--url", f"http://127.0.0.1:{listener.getsockname()[1]}"], cwd=REPO,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "MEDSERVE_CACHE": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while not accepted and time.monotonic() < deadline:  # the model lookup is waiting for its answer
            time.sleep(0.1)
        assert accepted and out.is_dir()
        proc.send_signal(getattr(signal, signal_name))
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        listener.close()
        for connection in accepted:
            connection.close()
    assert proc.returncode == 128 + getattr(signal, signal_name), stderr
    assert stderr.strip().splitlines()[-1] == f"error: interrupted by {signal_name}", stderr
    assert not (tmp_path / "made").exists()


def test_waiting_for_a_job_outlasts_a_server_restart(tmp_path: Path) -> None:
    """One poll that found the server down (restarting: it keeps its jobs) ended `medserve infer` with 'cannot
    reach'; the wait now goes on while the server is back within a minute."""
    import json
    import threading
    import time

    from medserve.server.client import Client
    from tests.server.conftest import free_port

    port = free_port()
    job = {"id": "a" * 32, "state": "succeeded", "progress": 1.0}

    servers = []

    def start_later() -> None:
        time.sleep(3)
        servers.append(_answering_server(200, json.dumps(job).encode(), "application/json", port))
        servers[0].serve_forever()

    threading.Thread(target=start_later, daemon=True).start()
    try:
        assert Client(f"http://127.0.0.1:{port}").wait(job["id"], interval=0.1)["state"] == "succeeded"
    finally:
        if servers:
            servers[0].shutdown()
            servers[0].server_close()


def test_the_servers_log_is_one_json_object_per_line_uvicorns_lines_too(tmp_path: Path) -> None:
    """uvicorn installed its own plain-text handlers: 'WARNING:  Invalid HTTP request received.' (and its
    traceback of a 500) broke MEDSERVE_LOG_FORMAT=json's one object per line, and so did the start-up line."""
    import json
    import time

    from tests.server.conftest import ServerProcess, free_port

    port = free_port()
    server = ServerProcess(["--store", str(tmp_path / "store"), "--data-dir", str(tmp_path / "data")], port,
                           env={"MEDSERVE_LOG_FORMAT": "json"}).start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            conn.recv(65536)
        time.sleep(0.5)
    finally:
        server.stop()
    lines = [line for line in server.proc.stdout.read().decode().splitlines() if line.strip()]
    entries = [json.loads(line) for line in lines]  # the start-up line too (it was plain text)
    assert [entry["url"] for entry in entries if entry["msg"].startswith("medserve serving ")] == [
        f"http://127.0.0.1:{port}"], lines
    assert any(entry["logger"].startswith("uvicorn") and "Invalid HTTP request" in entry["msg"]
               for entry in entries), lines


def test_the_dicomweb_store_may_come_from_the_environment(monkeypatch, tmp_path: Path) -> None:
    """Credentials in --dicomweb show in `ps` to every local user; MEDSERVE_DICOMWEB keeps them off the command
    line, and a --dicomweb given wins."""
    from medserve.cli import build_parser
    from medserve.server.commands import config_from_args

    monkeypatch.setenv("MEDSERVE_DICOMWEB", "http://medserve:s3cret@127.0.0.1:8042/dicom-web")
    serve = ["serve", "--store", str(tmp_path / "store"), "--data-dir", str(tmp_path / "data")]
    assert config_from_args(build_parser().parse_args(serve)).dicomweb_url == (
        "http://medserve:s3cret@127.0.0.1:8042/dicom-web")
    given = build_parser().parse_args([*serve, "--dicomweb", "http://127.0.0.1:9/dicom-web", "--dicomweb-timeout",
                                       "90"])
    assert (config_from_args(given).dicomweb_url, config_from_args(given).dicomweb_timeout) == (
        "http://127.0.0.1:9/dicom-web", 90.0)


@pytest.mark.parametrize(("url", "expected"), [
    ("http://medserve:pa#ss@127.0.0.1:8042/dicom-web", "its port is not a number; a password holding '/', '?' or '#' "
                                                       "must be percent-encoded (%2F, %3F, %23)"),
    ("http://127.0.0.1:8042/dicom-web?pa=ss", "expected nothing after the DICOMweb root's path; a password holding "
                                              "'/', '?' or '#' must be percent-encoded (%2F, %3F, %23)"),
    ("127.0.0.1:8042/dicom-web", "expected an http:// or https:// URL naming a host"),
], ids=["hash-in-password", "query", "no-scheme"])
def test_serve_refuses_a_dicomweb_url_it_cannot_use_without_showing_it(tmp_path: Path, url: str, expected: str) -> None:
    """An unencoded '#' in the password left the URL whole where it is shown without credentials, and httpx
    refused it at the first pull with part of the password in the message."""
    proc = _cli("serve", "--store", str(tmp_path), "--data-dir", str(tmp_path / "d"),
                env={**os.environ, "MEDSERVE_DICOMWEB": url})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"error: --dicomweb (or MEDSERVE_DICOMWEB): {expected}", proc.stderr


@pytest.mark.parametrize(("host", "url"), [("127.0.0.1", "http://127.0.0.1:8000"),
                                         ("localhost", "http://localhost:8000"), ("::1", "http://[::1]:8000")])
def test_the_start_up_line_s_url_puts_an_ipv6_address_in_brackets(host: str, url: str) -> None:
    """'http://::1:8000' is no URL: a log reader taking the url field could not connect."""
    assert http_url(host, 8000) == url


def test_an_upload_goes_on_when_a_parallel_run_removes_the_cached_zip(thr_server, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """Two runs of one study share its cached zip, and the first to finish removes it: tuspy opens the file again
    for every chunk, so the other run's next chunk failed (ValueError: invalid file). It reads through a link of
    its own, removed when it ends."""
    from medserve.server.client import CHUNK, Client

    monkeypatch.setenv("MEDSERVE_CACHE", str(tmp_path / "cache"))
    archive = tmp_path / "cache" / "zips" / "study.zip"
    archive.parent.mkdir(parents=True)
    content = os.urandom(2 * CHUNK + 1000)
    archive.write_bytes(content)

    def remove_the_zip(done: int, total: int) -> None:
        archive.unlink(missing_ok=True)  # the other run finished meanwhile

    upload_id = Client(thr_server.url).upload(archive, remove_the_zip)
    assert (thr_server.config.uploads_dir / f"{upload_id}.bin").read_bytes() == content
    assert list(archive.parent.iterdir()) == []  # its link is gone too


def _answering_in_turn(answers: list[tuple[int, bytes, dict[str, str]]]) -> Any:
    """An HTTP server on 127.0.0.1 (a proxy before a restarting server, say) that answers the requests it gets with
    `answers` in turn, the last one for ever (not started: call serve_forever); `.times` holds when each came."""
    import http.server
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            server.times.append(time.monotonic())
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, body, headers = answers[min(len(server.times), len(answers)) - 1]
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.times = []
    return server


@pytest.mark.parametrize("patience", [60.0, 2.0], ids=["back-in-time", "never-back"])
def test_the_client_waits_out_answers_that_say_not_now(monkeypatch, patience: float) -> None:
    """While it waited for a job, `medserve infer` ended on the first 503 (the server's own database_busy, with
    Retry-After) or a proxy's 502 before a restarting server. Such answers are now tried again, after the
    Retry-After or 1, 2, 4, 8 s, for a minute; other errors end at once."""
    import json
    import threading
    import time

    from medserve.server import client as client_module
    from medserve.server.client import Client, ClientError

    monkeypatch.setattr(client_module, "UNREACHABLE_PATIENCE", patience)
    job = {"id": "a" * 32, "state": "succeeded", "progress": 1.0}
    busy = (503, b'{"error": "database_busy", "message": "busy"}', {"Retry-After": "1"})
    server = _answering_in_turn([(*busy[:2], {"Retry-After": "0"}), (502, b"<html>Bad Gateway</html>", {}), busy, busy,
                                 (200, json.dumps(job).encode(), {"Content-Type": "application/json"})]
                                if patience > 10 else [busy])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = Client(f"http://127.0.0.1:{server.server_address[1]}")
    try:
        if patience > 10:
            assert client.wait(job["id"], interval=0.1)["state"] == "succeeded"
            waits = [round(later - earlier, 1) for earlier, later in zip(server.times, server.times[1:])]
            assert len(waits) == 4 and waits[0] >= 1.0 and waits[1] >= 2.0 and waits[2] >= 1.0, waits  # 0 is 1 s
        else:
            started = time.monotonic()
            with pytest.raises(ClientError, match="^server answered 503: busy$"):
                client.wait(job["id"], interval=0.1)
            assert 1.0 <= time.monotonic() - started < 5.0
    finally:
        server.shutdown()
        server.server_close()


def test_a_job_submitted_without_a_key_is_not_sent_twice_after_a_proxys_502_or_504() -> None:
    """A proxy's 504 may come after the server took the job: a second POST would run it twice (and STOW two
    SEGs with --writeback). Only answers that say the request was refused untouched are tried again then."""
    import threading

    from medserve.server.client import Client, ClientError

    server = _answering_in_turn([(504, b"<html>Gateway Timeout</html>", {}),
                                 (201, b'{"id": "b", "state": "queued"}', {"Content-Type": "application/json"})])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ClientError, match="^server answered 504: <html>Gateway Timeout</html>$"):
            Client(f"http://127.0.0.1:{server.server_address[1]}").submit("thr", {"study": "1.2.3"}, None)
        assert len(server.times) == 1
        assert Client(f"http://127.0.0.1:{server.server_address[1]}").submit("thr", {"study": "1.2.3"}, "key")[
            "id"] == "b"  # with a key, the server answers a repeat with the same job
    finally:
        server.shutdown()
        server.server_close()


def test_an_upload_resumes_after_the_server_restarts_under_it(tmp_path: Path, store_dir: Path) -> None:
    """A server killed mid-upload ended `medserve infer` at once with urllib3's whole text; the upload now waits
    for the server to be back and resumes from the offset it kept, byte for byte."""
    import hashlib
    import threading

    from medserve.server.client import CHUNK, Client
    from tests.server.conftest import ServerProcess, free_port

    archive = tmp_path / "study.zip"
    archive.write_bytes(os.urandom(2 * CHUNK + 12345))  # what the server stores is checked, not used
    port = free_port()
    args = ["--store", str(store_dir), "--data-dir", str(tmp_path / "data")]
    server = ServerProcess(args, port, env={"MEDSERVE_CACHE": str(tmp_path / "cache")}).start()
    restarted = ServerProcess(args, port)
    restart = threading.Timer(6.0, restarted.start)  # past tuspy's own 3 tries a second apart

    def kill_after_the_first_chunk(done: int, total: int) -> None:
        if not restart.is_alive() and server.proc.poll() is None:
            server.kill()
            restart.start()

    os.environ["MEDSERVE_CACHE"] = str(tmp_path / "cache")
    try:
        upload_id = Client(server.url).upload(archive, kill_after_the_first_chunk)
        stored = tmp_path / "data" / "uploads" / f"{upload_id}.bin"
        assert hashlib.sha256(stored.read_bytes()).digest() == hashlib.sha256(archive.read_bytes()).digest()
    finally:
        os.environ.pop("MEDSERVE_CACHE", None)
        server.kill()
        restart.cancel()
        if restart.is_alive():
            restart.join()  # a started server must not outlive the test
        restarted.stop()


@pytest.mark.parametrize(("value", "expected"), [("7", 7), ("²", None), ("Wed, 21 Oct 2026 07:28:00 GMT", None)])
def test_a_retry_after_is_read_as_whole_seconds_or_not_at_all(value: str, expected: int | None) -> None:
    """The client's own Retry-After reader took '²' (str.isdigit says yes) to float() and failed with ValueError;
    it now reads the header as the server reads its integer headers."""
    import httpx

    from medserve.server.client import Client, ClientError

    answer = httpx.Response(503, headers=[(b"retry-after", value.encode("latin-1"))], content=b"{}")
    with pytest.raises(ClientError) as refused:
        Client("http://127.0.0.1:1")._check(answer)
    assert (refused.value.retryable, refused.value.retry_after) == (True, expected)
