"""Async jobs: submit/poll/result, Idempotency-Key, cancel, and recovery after `kill -9` of `medserve serve`."""

from __future__ import annotations

import io
import sqlite3
import time
import zipfile
from pathlib import Path

import httpx
import pydicom
import pytest

from tests.conftest import make_threshold_bundle
from tests.server.conftest import (FakeDicomWeb, ServerProcess, add_bundle, free_port, multipart_files, small_study,
                                   with_thr)


def _wait(url: str, job_id: str, states: tuple[str, ...], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/jobs/{job_id}").json()
        assert "state" in job, job
        if job["state"] in states:
            return job
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} not in {states}: {job}")


def _gone(path: Path, timeout: float = 10) -> None:
    """The worker drops a job's input (and the folder of a job without a result) right after recording how the
    job ended (so a crash in between re-runs it with its input): wait for that step rather than race it."""
    deadline = time.monotonic() + timeout
    while path.exists():
        assert time.monotonic() < deadline, f"{path} still there {timeout} s after the job ended"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_study(tmp_path_factory.mktemp("jobs") / "study")


def test_job_lifecycle_idempotency_cancel(make_server, study: Path) -> None:
    server = make_server()
    add_bundle(server.config.store, "demo")
    server.store.wait_until("demo", ("loaded",), 60)
    url = server.url
    files = multipart_files(study)
    r = httpx.post(url + "/v1/jobs?model=demo", files=files, headers={"Idempotency-Key": "k1"})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["state"] in ("queued", "running") and r.headers["Location"] == f"/v1/jobs/{job['id']}"
    again = httpx.post(url + "/v1/jobs?model=demo", files=files, headers={"Idempotency-Key": "k1"})
    assert again.json()["id"] == job["id"] and again.headers["Idempotent-Replayed"] == "true"
    done = _wait(url, job["id"], ("succeeded", "failed"))
    assert done["state"] == "succeeded", done
    assert done["progress"] == 1 and done["timings"]["total_s"] > 0 and done["segments"] is not None
    seg = httpx.get(url + done["result_url"])
    assert seg.status_code == 200 and pydicom.dcmread(io.BytesIO(seg.content)).Modality == "SEG"
    nifti = httpx.get(url + done["result_url"] + "?format=nifti")
    assert nifti.status_code == 200 and nifti.content[:2] == b"\x1f\x8b"
    # unknown model and unknown job
    assert httpx.post(url + "/v1/jobs?model=nope", files=files).status_code == 404
    assert httpx.get(url + "/v1/jobs/" + "0" * 32).status_code == 404
    # cancel: a queue of three behind one worker; cancel the last while queued, then a running one
    ids = [httpx.post(url + "/v1/jobs?model=demo", files=files).json()["id"] for _ in range(3)]
    cancelled = httpx.delete(f"{url}/v1/jobs/{ids[2]}").json()
    assert cancelled["state"] == "cancelled"
    running = _wait(url, ids[0], ("running", "succeeded"))
    if running["state"] == "running":
        r = httpx.delete(f"{url}/v1/jobs/{ids[0]}")
        if r.status_code == 200:  # still running when the DELETE arrived: it stays cancelled, no result
            assert r.json()["state"] == "cancelled"
            time.sleep(1.0)
            assert httpx.get(f"{url}/v1/jobs/{ids[0]}").json()["state"] == "cancelled"
            assert httpx.get(f"{url}/v1/jobs/{ids[0]}/result").status_code == 409
        else:  # it finished in between
            assert r.status_code == 409 and r.json()["error"] == "job_finished"
    assert _wait(url, ids[1], ("succeeded",))["state"] == "succeeded"
    time.sleep(0.5)
    assert httpx.get(f"{url}/v1/jobs/{ids[2]}").json()["state"] == "cancelled"
    assert httpx.get(f"{url}/v1/jobs/{ids[2]}/result").status_code == 409
    assert httpx.delete(f"{url}/v1/jobs/{ids[1]}").status_code == 409
    listed = httpx.get(url + "/v1/jobs").json()["jobs"]
    assert {j["id"] for j in listed} >= set(ids)


def test_kill_9_recovery(tmp_path: Path, store_dir: Path, study: Path, demo_study: Path) -> None:
    """kill -9 while a job runs: after a restart the finished job's result is still served and the interrupted
    job runs again (attempt 2) to success; a job interrupted on its last attempt is failed with the reason."""
    add_bundle(store_dir, "demo")
    data = tmp_path / "data"
    port = free_port()
    args = ["--store", str(store_dir), "--data-dir", str(data), "--stable-seconds", "0.5", "--poll-interval",
            "0.2", "--device", "cpu", "--job-max-attempts", "2"]
    server = ServerProcess(args, port).start()
    url = server.url
    try:
        files = multipart_files(study)
        first = httpx.post(url + "/v1/jobs?model=demo", files=files).json()
        done = _wait(url, first["id"], ("succeeded",))
        before = httpx.get(url + done["result_url"]).content
        second = httpx.post(url + "/v1/jobs?model=demo", files=multipart_files(demo_study)).json()
        _wait(url, second["id"], ("running",), 60)
        server.kill()
    finally:
        server.kill()
    # Force a third job into "running on its last attempt", as if it had already been interrupted once.
    db = sqlite3.connect(data / "jobs.sqlite")
    third_id = "f" * 32
    db.execute("INSERT INTO jobs (id, model, state, input, created, attempts) VALUES (?, 'demo', 'running', ?, ?, 2)",
               (third_id, '{"kind": "dicom", "path": "/nonexistent"}', time.time()))
    db.commit()
    db.close()
    server = ServerProcess(args, port).start()
    try:
        assert httpx.get(url + done["result_url"]).content == before
        rerun = _wait(url, second["id"], ("succeeded", "failed"))
        assert rerun["state"] == "succeeded" and rerun["attempts"] == 2, rerun
        failed = httpx.get(f"{url}/v1/jobs/{third_id}").json()
        assert failed["state"] == "failed" and "interrupted" in failed["error"]
    finally:
        server.stop()


def test_job_waits_for_a_busy_model_past_the_queue_timeout(make_server, study: Path) -> None:
    """A job whose model stays busy longer than the sync queue timeout keeps waiting (a sync request would get
    503); cancelling it while it waits frees the worker for the next job."""
    server = with_thr(make_server(queue_timeout=0.5))
    url, files = server.url, multipart_files(study)
    gate = server.store.entry("thr").gate
    gate.enter(lambda: None)
    try:
        first = httpx.post(url + "/v1/jobs?model=thr", files=files).json()
        second = httpx.post(url + "/v1/jobs?model=thr", files=files).json()
        assert httpx.post(url + "/v1/models/thr/infer", files=files).status_code == 503
        time.sleep(1.5)
        waiting = _wait(url, first["id"], ("running",))
        assert waiting["stage"] == "waiting for the model" and httpx.get(f"{url}/v1/jobs/{first['id']}").json()[
            "state"] == "running"
        assert httpx.delete(f"{url}/v1/jobs/{first['id']}").json()["state"] == "cancelled"
        assert _wait(url, second["id"], ("running",), 10)["stage"] == "waiting for the model"
    finally:
        gate.leave()
    done = _wait(url, second["id"], ("succeeded", "failed"))
    assert done["state"] == "succeeded" and done["attempts"] == 1, done
    assert httpx.get(f"{url}/v1/jobs/{first['id']}").json()["state"] == "cancelled"


def test_idempotency_key_compares_the_model_from_any_source(thr_server, study: Path) -> None:
    """The same Idempotency-Key naming another model in the form or JSON body is a conflict, not a replay."""
    url, files = thr_server.url, multipart_files(study)
    first = httpx.post(url + "/v1/jobs", files=files, data={"model": "thr"}, headers={"Idempotency-Key": "k"})
    assert first.status_code == 202, first.text
    again = httpx.post(url + "/v1/jobs", files=files, data={"model": "thr"}, headers={"Idempotency-Key": "k"})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = httpx.post(url + "/v1/jobs", files=files, data={"model": "other"}, headers={"Idempotency-Key": "k"})
    assert other.status_code == 409 and other.json()["error"] == "idempotency_conflict", other.text
    other = httpx.post(url + "/v1/jobs", json={"upload": "0" * 32, "model": "other"}, headers={"Idempotency-Key": "k"})
    assert other.status_code in (404, 409), other.text  # the unknown upload may be noticed first
    assert _wait(url, first.json()["id"], ("succeeded",))["model"] == "thr"
    assert sorted(p.name for p in thr_server.config.jobs_dir.iterdir()) == [first.json()["id"]]


def test_writeback_rerun_after_a_crash_stows_the_same_seg(tmp_path: Path, store_dir: Path, study: Path) -> None:
    """kill -9 once the SEG has been STOWed but before the job is marked done: the re-run STOWs the same SEG
    instance again (which the store replaces), never a second, different SEG."""
    add_bundle(store_dir, "thr", make_threshold_bundle(tmp_path / "thr"))
    servers: list[ServerProcess] = []

    def crash_on_first_stow() -> None:
        if len(store.stowed) == 1:
            servers[-1].kill()

    with FakeDicomWeb(study, on_stow=crash_on_first_stow) as store:
        args = ["--store", str(store_dir), "--data-dir", str(tmp_path / "data"), "--stable-seconds", "0.5",
                "--poll-interval", "0.2", "--device", "cpu", "--dicomweb", store.url]
        port = free_port()
        servers.append(ServerProcess(args, port).start())
        try:
            url = servers[0].url
            job = httpx.post(url + "/v1/jobs?model=thr", json={"study": "1.2.3", "writeback": True}).json()
            assert servers[0].proc.wait(timeout=120) == -9
            servers.append(ServerProcess(args, port).start())
            done = _wait(url, job["id"], ("succeeded", "failed"))
            assert done["state"] == "succeeded" and done["attempts"] == 2, done
        finally:
            servers[-1].stop()
    assert len(store.stowed) == 2 and store.stowed[0] == store.stowed[1], store.stowed


def _zip_of(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(folder.iterdir()):
            archive.write(path, path.name)
    return buffer.getvalue()


def test_finished_jobs_keep_their_result_not_their_input(make_server, base_config, study: Path) -> None:
    orphan = base_config.jobs_dir / ("f" * 32)  # a request that was saving its input when the server stopped
    (orphan / "input").mkdir(parents=True)
    server = with_thr(make_server())
    assert not orphan.exists()
    url, jobs = server.url, server.config.jobs_dir
    archive = _zip_of(study)
    submitted = [
        httpx.post(url + "/v1/jobs?model=thr", files=[("file", ("study.zip", archive, "application/zip"))]),
        httpx.post(url + "/v1/jobs?model=thr", content=archive, headers={"Content-Type": "application/zip"}),
        httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)),
    ]
    ids = [r.json()["id"] for r in submitted]
    assert all(r.status_code == 202 for r in submitted), [r.text for r in submitted]
    for job_id in ids:
        assert _wait(url, job_id, ("succeeded", "failed"))["state"] == "succeeded"
        _gone(jobs / job_id / "input")
        assert httpx.get(f"{url}/v1/jobs/{job_id}/result").status_code == 200


def test_a_job_cancelled_while_queued_leaves_no_folder_and_a_failed_one_neither(make_server, study: Path) -> None:
    server = with_thr(make_server(job_workers=1))
    url, jobs = server.url, server.config.jobs_dir
    with server.store.use("thr", lambda: None):  # the model is busy: the worker waits, later jobs stay queued
        first = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()["id"]
        queued = httpx.post(url + "/v1/jobs?model=thr",
                            files=[("file", ("study.zip", _zip_of(study), "application/zip"))]).json()["id"]
        assert sorted(p.name for p in (jobs / queued / "input").iterdir()) == ["dicom"]  # the zip is gone
        assert httpx.delete(f"{url}/v1/jobs/{queued}").json()["state"] == "cancelled"
        assert not (jobs / queued).exists()
    assert _wait(url, first, ("succeeded",))["state"] == "succeeded"
    broken = [("file", ("IM0.dcm", (study / sorted(p.name for p in study.iterdir())[0]).read_bytes()[:-500],
                        "application/dicom"))]  # a truncated slice: the job fails
    failed = httpx.post(url + "/v1/jobs?model=thr", files=broken).json()["id"]
    job = _wait(url, failed, ("succeeded", "failed"))
    assert job["state"] == "failed"
    assert job["error"].startswith("IM0.dcm: pixel data is truncated"), job["error"]  # the client's name for it
    _gone(jobs / failed)  # no result: no folder


def test_a_job_on_a_model_still_being_copied_waits_for_it(make_server, study: Path) -> None:
    server = make_server(stable_seconds=2.0)
    add_bundle(server.config.store, "fresh", make_threshold_bundle(Path(server.config.data_dir) / "fresh_bundle"))
    deadline = time.monotonic() + 10
    while not any(e.name == "fresh" for e in server.store.entries()):  # found, but not settled yet
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.store.entry("fresh").state == "copying"
    job = httpx.post(server.url + "/v1/jobs?model=fresh", files=multipart_files(study)).json()
    done = _wait(server.url, job["id"], ("succeeded", "failed"))
    assert done["state"] == "succeeded", done


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # the stop is no crash
def test_a_job_interrupted_by_a_stop_is_rerun_after_the_restart(make_server, study: Path) -> None:
    first = with_thr(make_server())
    with first.store.use("thr", lambda: None):  # the model is busy: the job waits, claimed, when the server stops
        job = httpx.post(first.url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        _wait(first.url, job["id"], ("running",))
        first.__exit__(None, None, None)
    second = make_server(port=free_port())  # the same store and data folder; the model is found anew
    done = _wait(second.url, job["id"], ("succeeded", "failed"))
    assert done["state"] == "succeeded" and done["attempts"] == 1, done  # a stop does not use up an attempt


def test_a_cancel_racing_the_jobs_success_is_one_or_the_other(base_config, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job succeeds (the worker's own update) right after the cancel request has looked the job up: the
    answer is then 409 job_finished or a job that stays cancelled, never 200 with a succeeded job."""
    from medserve.server.errors import ApiError
    from medserve.server.inputs import InputSpec
    from medserve.server.jobs import JobQueue
    from medserve.server.store import ModelStore

    queue = JobQueue(base_config, ModelStore(base_config))  # no workers: the test plays the worker
    try:
        queue.submit("job-1", "demo", InputSpec("dicom", base_config.data_dir / "in"), False, None)
        assert queue._claim()["id"] == "job-1"
        read_row = queue._row
        succeeded: list[bool] = []

        def row_then_success(job_id: str):  # noqa: ANN202
            row = read_row(job_id)
            if not succeeded:
                succeeded.append(queue._succeed(job_id, {}))
            return row

        monkeypatch.setattr(queue, "_row", row_then_success)
        try:
            answer = queue.cancel("job-1")
        except ApiError as error:
            assert (error.status, error.code) == (409, "job_finished"), error
            assert read_row("job-1")["state"] == "succeeded"
        else:
            assert answer["state"] == read_row("job-1")["state"] == "cancelled", answer
            assert succeeded == [False]  # the worker saw the cancel and drops its result
    finally:
        queue.close()


def test_a_replayed_upload_job_does_not_extract_the_upload_again(thr_server, study: Path, monkeypatch) -> None:
    """{"upload": ID} with the Idempotency-Key of a job on the model in the query: the job is answered at once,
    without staging the upload again (the CLI's re-runs do this; a study can be gigabytes)."""
    from medserve.server import inputs

    url = thr_server.url
    created = httpx.post(url + "/v1/uploads", headers={"Tus-Resumable": "1.0.0", "Upload-Length": str(len(_zip_of(study)))})
    httpx.patch(created.headers["Location"], content=_zip_of(study), headers={
        "Tus-Resumable": "1.0.0", "Upload-Offset": "0", "Content-Type": "application/offset+octet-stream"})
    body = {"upload": created.headers["Location"].rsplit("/", 1)[-1]}
    first = httpx.post(url + "/v1/jobs?model=thr", json=body, headers={"Idempotency-Key": "u"})
    assert first.status_code == 202, first.text
    staged: list[Path] = []
    real_stage = inputs.stage_file
    monkeypatch.setattr(inputs, "stage_file", lambda path, *args: staged.append(path) or real_stage(path, *args))
    again = httpx.post(url + "/v1/jobs?model=thr", json=body, headers={"Idempotency-Key": "u"})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"] and staged == []
    other = httpx.post(url + "/v1/jobs?model=other", json=body, headers={"Idempotency-Key": "u"})
    assert other.status_code == 409 and other.json()["error"] == "idempotency_conflict", other.text
    assert _wait(url, first.json()["id"], ("succeeded",))["state"] == "succeeded"
