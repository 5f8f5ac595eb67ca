"""Async jobs: submit/poll/result, Idempotency-Key, cancel, and recovery after `kill -9` of `medserve serve`."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import io
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import httpx
import nibabel as nib
import numpy as np
import pydicom
import pytest

from medserve.errors import ConfigurationError
from medserve.server.app import create_app
from medserve.server.lock import DataDirInUse, lock_data_dir
from medserve.server.states import FINAL_STATES
from tests.conftest import make_threshold_bundle, run_unprivileged
from tests.server.conftest import (REPO, FakeDicomWeb, ServerProcess, add_bundle, free_port, multipart_files,
                                   small_study, with_thr)


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
    source = pydicom.dcmread(next(p for p in sorted(study.iterdir()) if p.is_file()), stop_before_pixels=True)
    assert done["segmented"] == {"study_uid": source.StudyInstanceUID, "series_uid": source.SeriesInstanceUID}
    seg = httpx.get(url + done["result_url"])
    assert seg.status_code == 200 and pydicom.dcmread(io.BytesIO(seg.content)).Modality == "SEG"
    nifti = httpx.get(url + done["result_url"] + "?format=nifti")
    assert nifti.status_code == 200 and nifti.content[:2] == b"\x1f\x8b"
    for accept, media in (("application/gzip", "application/gzip"), ("application/dicom", "application/dicom"),
                          ("application/gzip;q=0.3, application/dicom;q=0.9", "application/dicom"),
                          ("application/dicom;q=0, application/gzip", "application/gzip"),
                          ("application/x-nifti, application/dicom", "application/gzip")):
        by_accept = httpx.get(url + done["result_url"], headers={"Accept": accept})
        assert by_accept.status_code == 200 and by_accept.headers["content-type"] == media
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
        cancelled = httpx.delete(f"{url}/v1/jobs/{first['id']}").json()
        assert (cancelled["state"], cancelled["progress"]) == ("cancelled", 0), cancelled  # no result: no progress
        assert _wait(url, second["id"], ("running",), 10)["stage"] == "waiting for the model"
    finally:
        gate.leave()
    done = _wait(url, second["id"], ("succeeded", "failed"))
    assert done["state"] == "succeeded" and done["attempts"] == 1, done
    assert httpx.get(f"{url}/v1/jobs/{first['id']}").json()["state"] == "cancelled"


def test_concurrent_requests_with_one_idempotency_key_make_one_job_and_both_get_it(thr_server, study: Path) -> None:
    """Both requests are past the key's lookup before either inserts (slow bodies): the one that loses the insert
    is answered as a replay (200, the same job), not 409."""
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(study.iterdir()):
            zf.write(path, path.name)

    def slow_body():
        time.sleep(1.0)
        yield archive.getvalue()

    answers: dict[int, httpx.Response] = {}

    def post(index: int) -> None:
        answers[index] = httpx.post(thr_server.url + "/v1/jobs?model=thr", content=slow_body(), timeout=60,
                                    headers={"Content-Type": "application/zip", "Idempotency-Key": "race"})

    threads = [threading.Thread(target=post, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r.status_code for r in answers.values()) == [200, 202], [r.text for r in answers.values()]
    assert answers[0].json()["id"] == answers[1].json()["id"]
    assert len(httpx.get(thr_server.url + "/v1/jobs").json()["jobs"]) == 1


def test_a_replay_naming_its_model_in_the_json_body_needs_no_upload(thr_server, study: Path) -> None:
    """An Idempotency-Key replay of {"upload": ID, "model": M} is answered from the recorded job, as one naming
    the model in the query is: not re-staged, and still answered once the upload is gone."""
    tus = {"Tus-Resumable": "1.0.0"}
    archive = _zip_of(study)
    created = httpx.post(thr_server.url + "/v1/uploads", headers={**tus, "Upload-Length": str(len(archive))})
    location = created.headers["Location"]
    httpx.patch(location, content=archive,
                headers={**tus, "Upload-Offset": "0", "Content-Type": "application/offset+octet-stream"})
    body, key = {"upload": location.rsplit("/", 1)[-1], "model": "thr"}, {"Idempotency-Key": "body-model"}
    first = httpx.post(thr_server.url + "/v1/jobs", json=body, headers=key)
    assert first.status_code == 202, first.text
    assert httpx.delete(location, headers=tus).status_code == 204
    replay = httpx.post(thr_server.url + "/v1/jobs", json=body, headers=key)
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true", replay.text
    assert replay.json()["id"] == first.json()["id"]
    other = httpx.post(thr_server.url + "/v1/jobs", json={**body, "model": "other"}, headers=key)
    assert other.status_code == 409 and other.json()["error"] == "idempotency_conflict", other.text


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


def test_an_empty_idempotency_key_is_no_key_and_writeback_must_be_a_boolean(thr_server, study: Path) -> None:
    """A client's unset variable sends `Idempotency-Key:` empty: two such requests are two jobs, not a replay of
    the first for every later one. `writeback` that is not true or false is refused, not taken as false."""
    url, files = thr_server.url, multipart_files(study)
    first = httpx.post(url + "/v1/jobs?model=thr", files=files, headers={"Idempotency-Key": ""})
    second = httpx.post(url + "/v1/jobs?model=thr", files=files, headers={"Idempotency-Key": ""})
    assert first.status_code == second.status_code == 202, (first.text, second.text)
    assert first.json()["id"] != second.json()["id"]
    for query, form in (("&writeback=2", {}), ("", {"writeback": "yes please"})):
        r = httpx.post(url + "/v1/jobs?model=thr" + query, files=files, data=form)
        assert r.status_code == 400 and r.json()["error"] == "bad_parameter", r.text
        assert r.json()["message"] == f"writeback {form.get('writeback', '2')!r}: expected true or false"
    for job in (first, second):
        assert _wait(url, job.json()["id"], ("succeeded",))["state"] == "succeeded"


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


def test_a_job_cancelled_during_writeback_lists_no_outputs(make_server, study: Path) -> None:
    """Cancelled after its result was saved, while the SEG is being STOWed: the result is gone, and the job says
    so (no outputs), as a failed job does."""
    stowing, release = threading.Event(), threading.Event()

    def hold_the_stow() -> None:
        stowing.set()
        release.wait(30)

    with FakeDicomWeb(study, on_stow=hold_the_stow) as store:
        server = with_thr(make_server(dicomweb_url=store.url))
        try:
            job = httpx.post(server.url + "/v1/jobs?model=thr", json={"study": "1.2.3", "writeback": True}).json()
            assert stowing.wait(120), "the write-back never started"
            assert httpx.delete(f"{server.url}/v1/jobs/{job['id']}").json()["state"] == "cancelled"
        finally:
            release.set()
        cancelled = _wait(server.url, job["id"], ("cancelled",))
        assert cancelled["outputs"] == [], cancelled
        listed = httpx.get(server.url + "/v1/jobs?state=cancelled").json()["jobs"]
        assert [j["outputs"] for j in listed] == [[]]


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


def test_a_queued_job_runs_after_its_data_dir_was_moved(make_server, study: Path, tmp_path: Path) -> None:
    """A job's input is recorded relative to the job's folder: a restart on the data dir moved (or reached by
    another path) still finds it."""
    first = with_thr(make_server())
    with first.store.use("thr", lambda: None):
        job = httpx.post(first.url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        _wait(first.url, job["id"], ("running",))
        first.__exit__(None, None, None)
    moved = tmp_path / "moved"
    first.config.data_dir.rename(moved)
    second = make_server(port=free_port(), data_dir=moved)
    done = _wait(second.url, job["id"], ("succeeded", "failed"))
    assert done["state"] == "succeeded", done


def test_a_job_whose_input_was_removed_behind_the_servers_back_fails_saying_so(make_server, study: Path) -> None:
    """It failed with "input folder . does not exist": the server's path, shortened for the client, said nothing."""
    server = with_thr(make_server())
    with server.store.use("thr", lambda: None):  # the job waits for the model
        job = httpx.post(server.url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        _wait(server.url, job["id"], ("running",))
        shutil.rmtree(server.config.jobs_dir / job["id"] / "input")
    failed = _wait(server.url, job["id"], ("succeeded", "failed"))
    assert (failed["state"], failed["error"]) == ("failed", "the job's input is gone from the server's data dir "
                                                            "(removed while the job waited or ran); submit the job "
                                                            "again"), failed


def test_the_job_list_pages_on_with_offset(base_config, thr_server, study: Path) -> None:
    """`offset` was ignored and `limit` stops at 1000: older jobs could not be listed at all."""
    from medserve.server.inputs import InputSpec
    from medserve.server.jobs import JobQueue
    from medserve.server.store import ModelStore

    queue = JobQueue(base_config, ModelStore(base_config))  # no workers: the jobs stay queued
    try:
        for number in range(5):
            queue.submit(f"job-{number}", "demo", InputSpec("dicom", queue.job_dir(f"job-{number}")), False, None)
        pages = [[job["id"] for job in queue.list(limit=2, offset=offset)] for offset in (0, 2, 4, 6)]
    finally:
        queue.close()
    assert sorted(sum(pages, [])) == [f"job-{number}" for number in range(5)] and pages[-1] == []
    assert [len(page) for page in pages] == [2, 2, 1, 0]
    r = httpx.get(thr_server.url + "/v1/jobs?offset=-1")
    assert r.status_code == 400 and r.json() == {"error": "bad_parameter",
                                                 "message": "offset -1 is negative; expected 0 or more"}, r.text


def test_a_job_cancelled_while_running_leaves_no_files_after_a_crash(base_config, study: Path) -> None:
    """Cancelled while it ran, and the server died before the worker noticed: the next start removes what the
    job left (its input, a partial result), as the worker would have."""
    from medserve.server.inputs import InputSpec
    from medserve.server.jobs import JobQueue
    from medserve.server.store import ModelStore

    queue = JobQueue(base_config, ModelStore(base_config))  # no workers: the test plays the worker
    folder = queue.job_dir("job-1")
    shutil.copytree(study, folder / "input" / "dicom")
    queue.submit("job-1", "demo", InputSpec("dicom", folder / "input" / "dicom"), False, None)
    assert queue._claim()["id"] == "job-1"
    (folder / "result.tmp").mkdir()
    (folder / "result.tmp" / "seg.dcm").write_bytes(b"partial")
    assert queue.cancel("job-1")["state"] == "cancelled"
    queue.close()  # the worker never got to drop the job's files
    assert (folder / "input" / "dicom").is_dir()
    JobQueue(base_config, ModelStore(base_config)).close()
    assert not folder.exists()


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
    created = httpx.post(url + "/v1/uploads",
                         headers={"Tus-Resumable": "1.0.0", "Upload-Length": str(len(_zip_of(study)))})
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


def test_a_second_server_on_the_same_data_dir_is_refused_before_touching_it(make_server, study: Path) -> None:
    """`medserve serve` on a data dir another server uses exits with one line naming the holder, and leaves the
    first server's running job (its row and its folder) as they were: no recovery ran."""
    server = with_thr(make_server())
    with server.store.use("thr", lambda: None):  # the model is busy: the job stays running, waiting for it
        job = httpx.post(server.url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        _wait(server.url, job["id"], ("running",))
        proc = subprocess.run([sys.executable, "-m", "medserve.cli", "serve", "--store", str(server.config.store),
                               "--data-dir", str(server.config.data_dir), "--port", str(server.config.port)],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == (f"error: data dir {server.config.data_dir} is in use by "
                                                        f"another medserve serve (pid {os.getpid()})"), proc.stderr
        assert "Traceback" not in proc.stderr
        still = httpx.get(f"{server.url}/v1/jobs/{job['id']}").json()
        assert (still["state"], still["attempts"], still["stage"]) == ("running", 1, "waiting for the model"), still
        assert (server.config.jobs_dir / job["id"] / "input" / "dicom").is_dir()
    assert _wait(server.url, job["id"], ("succeeded", "failed"))["state"] == "succeeded"


def test_a_writeback_the_store_refuses_fails_the_job_and_keeps_no_result(make_server, study: Path) -> None:
    """A STOW-RS answer of 202 with a Failed SOP Sequence is a refusal, not a success: the job fails naming how
    many instances were refused and why, its write-back shows as failed, and it lists (and keeps) no result."""
    with FakeDicomWeb(study) as store:
        server = with_thr(make_server(dicomweb_url=store.url))
        url = server.url
        done = httpx.post(url + "/v1/jobs?model=thr", json={"study": "1.2.3", "writeback": True}).json()
        done = _wait(url, done["id"], ("succeeded", "failed"))
        assert done["state"] == "succeeded", done
        assert done["writeback_result"] == {"target": store.url, "state": "done", "error": None}
        failed_item = {"00081150": {"vr": "UI", "Value": ["1.2.840.10008.5.1.4.1.1.66.4"]},  # SOP Class: SEG
                       "00081197": {"vr": "US", "Value": [0xA700]}}  # Failure Reason: out of resources
        refused = {"00081198": {"vr": "SQ", "Value": [failed_item]}}  # Failed SOP Sequence
        store.stow_answer = (202, refused)
        job = httpx.post(url + "/v1/jobs?model=thr", json={"study": "1.2.3", "writeback": True}).json()
        assert job["writeback_result"] == {"target": store.url, "state": "pending", "error": None}
        job = _wait(url, job["id"], ("succeeded", "failed"))
    assert len(store.stowed) == 2
    expected = (f"storing the SEG back to {store.url} failed: STOW-RS answered 202 but the store refused 1 of 1 "
                "instances (failure reasons: 0xA700 (out of resources))")
    assert (job["state"], job["error"]) == ("failed", expected), job
    assert job["writeback_result"] == {"target": store.url, "state": "failed", "error": expected}
    assert job["outputs"] == [] and job["result_url"] is None and job["progress"] == 0, job
    assert job["segmented"] is None and done["segmented"] is not None  # was kept with the result gone
    result = httpx.get(f"{url}/v1/jobs/{job['id']}/result")
    assert result.status_code == 409 and result.json()["error"] == "job_has_no_result", result.text
    _gone(server.config.jobs_dir / job["id"])  # no result: no folder
    assert (server.config.jobs_dir / done["id"] / "result").is_dir()


def test_a_writeback_the_store_answers_as_stored_but_drops_fails_the_job(make_server, study: Path) -> None:
    """Orthanc with a filter that rejects SEGs answers the STOW 200 and lists the SEG as stored: the job said
    `done` and succeeded, and the store had nothing. The SEG is now searched for (QIDO-RS) after the STOW."""
    with FakeDicomWeb(study) as store:
        store.keeps_stowed = False
        server = with_thr(make_server(dicomweb_url=store.url))
        job = httpx.post(server.url + "/v1/jobs?model=thr", json={"study": "1.2.3", "writeback": True}).json()
        job = _wait(server.url, job["id"], ("succeeded", "failed"))
    [[seg_uid]] = store.stowed
    assert job["state"] == "failed" and job["writeback_result"]["state"] == "failed", job
    assert re.fullmatch(rf"storing the SEG back to {re.escape(store.url)} failed: STOW-RS answered 200, but the "
                        rf"store does not list instance {re.escape(seg_uid)} afterwards \(QIDO-RS /studies/[\d.]+/"
                        r"series/[\d.]+/instances\): it did not keep it \(a filter or rule of the store may drop "
                        r"SEGs\)", job["error"]), job["error"]
    assert sum("/instances?SOPInstanceUID=" in path for path in store.paths) == 4  # asked four times


def test_cancelling_a_job_that_pulls_from_a_slow_store_frees_its_worker(make_server, study: Path) -> None:
    """The pull went on to the end of the store's answer (here 30 s, for a real series hours) with the job
    cancelled, and every later job waited behind it in the one worker."""
    with FakeDicomWeb(study) as store:
        store.trickle = 1000
        server = with_thr(make_server(dicomweb_url=store.url))
        slow = httpx.post(server.url + "/v1/jobs?model=thr", json={"study": "1.2.3"}).json()
        _wait(server.url, slow["id"], ("running",))
        deadline = time.monotonic() + 30
        while not store.paths:
            assert time.monotonic() < deadline, "the pull never started"
            time.sleep(0.1)
        assert httpx.delete(f"{server.url}/v1/jobs/{slow['id']}").json()["state"] == "cancelled"
        assert store.gone_away.wait(10), "the cancelled job still reads the store's answer"
        other = httpx.post(server.url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        assert _wait(server.url, other["id"], ("succeeded", "failed"), timeout=20)["state"] == "succeeded"


def test_a_writeback_being_retried_says_so_in_the_job_stage(make_server, study: Path) -> None:
    """The stage stayed 'storing the SEG back (STOW-RS)' through all the retries."""
    stages: list[str] = []

    with FakeDicomWeb(study) as store:
        store.stow_answer = (503, {})
        server = with_thr(make_server(dicomweb_url=store.url, dicomweb_retries=2, dicomweb_backoff=0.5))
        job = httpx.post(server.url + "/v1/jobs?model=thr", json={"study": "1.2.3", "writeback": True}).json()
        while (seen := httpx.get(f"{server.url}/v1/jobs/{job['id']}").json())["state"] not in FINAL_STATES:
            stages.append(seen["stage"])
            time.sleep(0.05)
    assert "storing the SEG back failed (dicomweb_store_failed); retry 1" in stages, stages
    assert seen["state"] == "failed" and len(store.stowed) == 3, seen


def test_a_request_naming_both_an_upload_and_a_study_is_refused(make_server) -> None:
    """The upload won without a word, and the study named beside it was ignored."""
    server = with_thr(make_server(dicomweb_url="http://127.0.0.1:9/dicom-web"))
    for path in ("/v1/models/thr/infer", "/v1/jobs?model=thr"):
        r = httpx.post(server.url + path, json={"upload": "abc", "study": "1.2.3"})
        assert r.status_code == 400 and r.json() == {
            "error": "bad_json", "message": "give either 'upload' (a tus upload) or 'study' (a DICOMweb reference), "
                                            "not both"}, r.text


def test_a_writeback_that_breaks_on_our_side_still_says_how_it_ended(make_server, study: Path, monkeypatch) -> None:
    """A fault while storing (not the store's answer) fails the job, and writeback_result says so rather than
    `not_attempted`: the STOW may have been sent."""
    from medserve.server.dicomweb import DicomWebClient

    def broken(self, files):
        raise RuntimeError("encoder on fire")

    with FakeDicomWeb(study) as store:
        server = with_thr(make_server(dicomweb_url=store.url))
        monkeypatch.setattr(DicomWebClient, "store", broken)
        job = httpx.post(server.url + "/v1/jobs?model=thr", json={"study": "1.2.3", "writeback": True}).json()
        job = _wait(server.url, job["id"], ("succeeded", "failed"))
    assert (job["state"], job["error"]) == ("failed", "RuntimeError: encoder on fire"), job
    assert job["writeback_result"] == {"target": store.url, "state": "failed", "error": "RuntimeError: encoder on fire"}


def test_jobs_from_before_the_writeback_record_read_as_they_ended(make_server, base_config) -> None:
    """A data dir from before writeback_result: its succeeded write-back job was done (it succeeded only after the
    STOW), and a failed one reports progress 0 and keeps no result, as jobs do now."""
    from medserve.server.jobs import SCHEMA

    base_config.jobs_dir.mkdir(parents=True)
    db = sqlite3.connect(base_config.db_path)
    db.executescript(SCHEMA)
    for job_id, state, progress in (("old-done", "succeeded", 1.0), ("old-failed", "failed", 0.95)):
        db.execute("INSERT INTO jobs (id, model, state, progress, input, writeback, created, outputs) VALUES "
                   "(?, 'thr', ?, ?, ?, 1, 0, ?)",
                   (job_id, state, progress, '{"kind": "dicomweb", "study": "1.2.3"}', '{"seg": "seg.dcm"}'))
        (base_config.jobs_dir / job_id / "result").mkdir(parents=True)
        (base_config.jobs_dir / job_id / "result" / "seg.dcm").write_bytes(b"")
    db.commit()
    db.close()
    url = with_thr(make_server()).url
    done, failed = (httpx.get(f"{url}/v1/jobs/{job_id}").json() for job_id in ("old-done", "old-failed"))
    assert done["writeback_result"] == {"target": None, "state": "done", "error": None}, done
    assert done["segmented"] is None  # not recorded then
    assert (failed["progress"], failed["outputs"], failed["writeback_result"]["state"]) == (0, [], "not_attempted")
    assert not (base_config.jobs_dir / "old-failed" / "result").exists()
    assert (base_config.jobs_dir / "old-done" / "result" / "seg.dcm").is_file()


def test_a_job_admitted_while_its_model_is_being_replaced_waits_for_the_files(make_server, study: Path) -> None:
    """The model's files start changing while the job waits for its turn: once admitted, the job waits for them
    to settle (as it does before), instead of failing with model_settling."""
    server = with_thr(make_server(stable_seconds=2.0))
    url = server.url
    with server.store.use("thr", lambda: None):  # the model is busy: the job waits for its turn
        job = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        _wait_for_stage(url, job["id"], "waiting for the model")
        assert httpx.post(url + "/v1/models/thr/unload").status_code == 200
        (server.config.store / "thr" / "configs" / "notes.json").write_text("{}")  # a new version being copied
        server.store.wait_until("thr", ("copying",), 10)
    done = _wait(url, job["id"], ("succeeded", "failed"))
    assert done["state"] == "succeeded" and done["attempts"] == 1, done


def _wait_for_stage(url: str, job_id: str, stage: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while (job := httpx.get(f"{url}/v1/jobs/{job_id}").json())["stage"] != stage:
        assert time.monotonic() < deadline, f"job {job_id} never reached {stage!r}: {job}"
        time.sleep(0.05)
    return job


def test_a_sync_request_is_not_queued_behind_a_job_waiting_for_the_model_to_settle(make_server,
                                                                                    study: Path) -> None:
    """A job waits for a model whose files are still changing; a sync request on it meanwhile answers 503
    model_settling at once (it would otherwise wait behind the job for the model's only slot)."""
    import threading

    server = with_thr(make_server(stable_seconds=2.0, queue_timeout=30.0))
    url = server.url
    assert httpx.post(url + "/v1/models/thr/unload").status_code == 200
    copied = threading.Event()

    def copying() -> None:  # a new version still being copied
        for number in range(200):
            if copied.is_set():
                return
            (server.config.store / "thr" / "configs" / "notes.json").write_text(str(number))
            time.sleep(0.3)

    threading.Thread(target=copying, daemon=True).start()
    try:
        server.store.wait_until("thr", ("copying",), 10)
        job = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        _wait_for_stage(url, job["id"], "waiting for the model's files to settle")
        started = time.monotonic()
        answer = httpx.post(url + "/v1/models/thr/infer", files=multipart_files(study), timeout=60)
        assert (answer.status_code, answer.json()["error"]) == (503, "model_settling"), answer.text
        assert time.monotonic() - started < 5
    finally:
        copied.set()
    assert _wait(url, job["id"], ("succeeded", "failed"))["state"] == "succeeded"


def test_a_clean_stop_records_jobs_that_finish_in_the_grace_period_and_requeues_the_rest(
        make_server, study: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graceful stop (what SIGTERM does): a job that finishes within the grace period is recorded as succeeded,
    not thrown away; one still inferring after it goes back to the queue with its attempt given back, and runs
    once at the next start."""
    import threading

    from medserve import pipeline

    real_run_study = pipeline.run_study
    release = threading.Event()
    calls: list[str] = []

    def run_study(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the first run outlasts the grace period
        calls.append("run")
        if len(calls) == 1:
            release.wait(60)
        else:
            time.sleep(1.0)
        return real_run_study(*args, **kwargs)

    monkeypatch.setattr(pipeline, "run_study", run_study)
    first = with_thr(make_server(job_workers=2, concurrency=2))
    url, files = first.url, multipart_files(study)
    def running(count: int) -> None:  # that many jobs inside the pipeline
        deadline = time.monotonic() + 30
        while len(calls) < count:
            assert time.monotonic() < deadline, calls
            time.sleep(0.05)

    slow = httpx.post(url + "/v1/jobs?model=thr", files=files).json()["id"]
    running(1)
    quick = httpx.post(url + "/v1/jobs?model=thr", files=files).json()["id"]
    running(2)
    first.__exit__(None, None, None)  # a graceful stop, as uvicorn does on SIGTERM
    with pytest.raises(DataDirInUse):  # the slow job's worker may still write into it: nobody takes it yet
        create_app(first.config)
    release.set()
    for worker in first.app.state.services.jobs._workers:  # the slow job's worker: it can record nothing any more
        worker.join(timeout=60)
    db = sqlite3.connect(first.config.db_path)
    rows = dict(db.execute("SELECT id, state || ' ' || attempts FROM jobs").fetchall())
    db.close()
    assert rows == {quick: "succeeded 1", slow: "queued 0"}, rows
    _free_within(first.config.data_dir, 10)  # given back once that worker has ended
    second = make_server(port=free_port())  # the same data folder
    done = _wait(second.url, slow, ("succeeded", "failed"))
    assert done["state"] == "succeeded" and done["attempts"] == 1, done
    assert httpx.get(f"{second.url}/v1/jobs/{quick}/result").status_code == 200


def _free_within(data_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            lock_data_dir(data_dir).close()
            return
        except DataDirInUse:
            assert time.monotonic() < deadline, f"{data_dir} is still locked"
            time.sleep(0.05)


def test_a_server_that_fails_to_start_leaves_the_data_dir_free(make_server, base_config, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("only-a-token\n")
    with pytest.raises(ConfigurationError, match="expected 'TOKEN SCOPE"):
        create_app(replace(base_config, tokens_file=tokens))
    _free_within(base_config.data_dir, 0)
    store_file = tmp_path / "not-a-folder"
    store_file.write_text("")
    failing = create_app(replace(base_config, store=store_file))  # fails when its lifespan starts the store

    async def start_and_stop() -> None:
        async with failing.router.lifespan_context(failing):
            pass

    with pytest.raises(OSError):
        asyncio.run(start_and_stop())
    _free_within(base_config.data_dir, 5)
    tokens.write_text("a-token infer\n")
    server = make_server(tokens_file=tokens)
    assert httpx.get(server.url + "/healthz").status_code == 200


def _answer_before_the_body(port: int, path: str, content_type: str) -> tuple[int, dict]:
    """Sends a request's head declaring a 1 GB body and none of it: only a server that answers without reading
    the body answers at all (within the socket's timeout)."""
    import json
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
                     f"Content-Length: {10**9}\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_job_on_an_unknown_model_is_refused_before_its_study_is_read(thr_server) -> None:
    url = thr_server.url
    unknown = {"error": "unknown_model", "message": "no model 'nope' in the store; available: thr"}
    for content_type in ("application/zip", "multipart/form-data; boundary=x"):
        assert _answer_before_the_body(thr_server.config.port, "/v1/jobs?model=nope", content_type) == (404, unknown)
    # Named in the JSON body: refused before the upload it names is looked up (or extracted).
    r = httpx.post(url + "/v1/jobs", json={"upload": "0" * 32, "model": "nope"})
    assert (r.status_code, r.json()) == (404, unknown), r.text
    r = httpx.post(url + "/v1/jobs", json={"upload": "0" * 32})
    assert r.status_code == 400 and r.json()["error"] == "no_model", r.text
    assert r.json()["message"].startswith("the 'model' field is missing"), r.text
    assert list(thr_server.config.jobs_dir.iterdir()) == []


def test_a_result_removed_from_the_data_dir_is_a_json_410(thr_server, study: Path) -> None:
    url = thr_server.url
    job = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
    assert _wait(url, job["id"], ("succeeded", "failed"))["state"] == "succeeded"
    for path in (thr_server.config.jobs_dir / job["id"] / "result").rglob("*.dcm"):
        path.unlink()
    r = httpx.get(f"{url}/v1/jobs/{job['id']}/result")
    assert r.status_code == 410 and r.json() == {
        "error": "result_gone", "message": f"job {job['id']}'s seg result is no longer on the server"}, r.text
    assert httpx.get(f"{url}/v1/jobs/{job['id']}/result?format=nifti").status_code == 200


def test_a_job_result_follows_the_accept_header_and_says_when_it_cannot(thr_server, tmp_path: Path) -> None:
    """A NIfTI input's job writes the label map only: `Accept: application/dicom` is 406, not a gzip answer."""
    import nibabel as nib
    import numpy as np

    image = tmp_path / "image.nii.gz"
    nib.save(nib.Nifti1Image(np.linspace(-1000, 1000, 16 ** 3, dtype=np.float32).reshape(16, 16, 16), np.eye(4)),
             image)
    url = thr_server.url
    job = httpx.post(url + "/v1/jobs?model=thr", files={"file": ("image.nii.gz", image.read_bytes())}).json()
    assert _wait(url, job["id"], ("succeeded", "failed"))["outputs"] == ["nifti"]
    r = httpx.get(f"{url}/v1/jobs/{job['id']}/result", headers={"Accept": "application/dicom"})
    assert r.status_code == 406 and r.json()["error"] == "format_unavailable", r.text
    for accept in ("*/*", "application/dicom, application/gzip;q=0.5"):  # the best format the job has
        r = httpx.get(f"{url}/v1/jobs/{job['id']}/result", headers={"Accept": accept})
        assert r.status_code == 200 and r.headers["content-type"] == "application/gzip", (accept, r.text)
    # The same reading of Accept for a sync request.
    r = httpx.post(url + "/v1/models/thr/infer", files={"file": ("image.nii.gz", image.read_bytes())},
                   headers={"Accept": "application/dicom, application/gzip;q=0.5"}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip", r.text


def test_a_folder_of_other_files_is_refused_as_data_dir(base_config, tmp_path: Path) -> None:
    """A start empties tmp/ and removes unknown folders under jobs/: a folder that is not medserve's is refused
    before anything in it is touched; one that holds a job database is medserve's, whatever else is there."""
    from medserve.server.lock import ForeignDataDir

    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    (home / "tmp" / "important.txt").write_text("keep me")
    (home / "notes.txt").write_text("mine")
    with pytest.raises(ForeignDataDir, match=r"holds files medserve did not write \(notes.txt\)"):
        create_app(replace(base_config, data_dir=home))
    assert (home / "tmp" / "important.txt").read_text() == "keep me"
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt", "tmp"]
    (home / "notes.txt").unlink()  # only what a server writes: medserve's
    _start_and_stop(create_app(replace(base_config, data_dir=home)))
    assert (home / "jobs.sqlite").is_file() and not (home / "tmp" / "important.txt").exists()
    (home / "notes.txt").write_text("added later, beside the database")
    _start_and_stop(create_app(replace(base_config, data_dir=home)))


@pytest.mark.parametrize("damage", ["truncated", "not-a-database", "read-only", "emptied", "removed"])
def test_a_damaged_or_lost_job_database_stops_the_start_before_anything_is_removed(
        base_config, tmp_path: Path, damage: str) -> None:
    """A damaged jobs.sqlite was a traceback (exit 1) after tmp/ had been emptied; an emptied or removed one made a
    fresh database, and the start then deleted every job folder, results included, without a word."""
    from medserve.server.lock import UnusableDataDir

    data = tmp_path / "data"
    _start_and_stop(create_app(replace(base_config, data_dir=data)))
    result = data / "jobs" / "0123456789abcdef0123456789abcdef" / "result"
    result.mkdir(parents=True)
    (result / "seg.dcm").write_bytes(b"a result")
    (data / "tmp" / "scratch").write_bytes(b"x")
    database, mounted = data / "jobs.sqlite", False
    for journal in ("jobs.sqlite-wal", "jobs.sqlite-shm"):
        (data / journal).unlink(missing_ok=True)
    if damage == "truncated":
        database.write_bytes(database.read_bytes()[:3000])
    elif damage == "not-a-database":
        database.write_bytes(b"\x17" * 8192)
    elif damage == "read-only":
        mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(database), str(database)]).returncode == 0
    elif damage == "emptied":
        database.write_bytes(b"")
    else:
        database.unlink()
    expected = {"emptied": r"jobs.sqlite is empty but jobs/ holds 1 job result\(s\): a start would delete them",
                "removed": r"jobs.sqlite is missing but jobs/ holds 1 job result\(s\)",
                "read-only": r"jobs.sqlite: cannot be used as the job database \(.*readonly.*\); make it writable"}.get(
        damage, r"jobs.sqlite: cannot be used as the job database \(.*\); restore it, or move it and jobs/ away")
    try:
        if damage == "read-only" and os.access(database, os.W_OK):
            pytest.skip("no read-only bind mount here")
        with pytest.raises(UnusableDataDir, match=expected):
            create_app(replace(base_config, data_dir=data))
    finally:
        if mounted:  # fails while the server holds the file open
            subprocess.run(["umount", str(database)], check=True)
    assert (result / "seg.dcm").read_bytes() == b"a result" and (data / "tmp" / "scratch").exists()
    assert not _data_dir_locked(data)  # given back for the corrected retry


def test_a_jobs_folder_that_cannot_be_listed_is_one_error(tmp_path: Path) -> None:
    """The lost-database check lists jobs/: a folder it cannot read was a traceback."""
    (tmp_path / "data" / "jobs").mkdir(parents=True)
    (tmp_path / "data" / "jobs").chmod(0)
    code = ("import sys; from pathlib import Path; from medserve.server.lock import UnusableDataDir, lock_data_dir\n"
            "try:\n    lock_data_dir(Path(sys.argv[1]))\nexcept UnusableDataDir as error:\n    print(error)")
    try:
        shown = run_unprivileged(code, tmp_path / "data")
    finally:
        (tmp_path / "data" / "jobs").chmod(0o755)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.strip() == (f"data dir {tmp_path / 'data'}: {tmp_path / 'data' / 'jobs'} cannot be read "
                                    "(Permission denied)")


def _data_dir_locked(data: Path) -> bool:
    with open(data / "serve.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def _start_and_stop(app) -> None:  # noqa: ANN001
    async def lifespan() -> None:
        async with app.router.lifespan_context(app):
            pass

    asyncio.run(lifespan())


@pytest.mark.parametrize("max_attempts", [2, 1])
def test_a_write_the_jobs_database_refuses_requeues_the_job_and_the_worker_goes_on(make_server, study: Path,
                                                                                      max_attempts: int,
                                                                                      caplog) -> None:
    """Another process holds the database's write lock past sqlite's 5 s wait (a full disk refuses writes the
    same way): the job's progress cannot be recorded. Its worker used to die, leaving the job `running` and every
    later job `queued` until a restart. Now the job goes back to the queue, as after a crash, while it has
    attempts left."""
    server = with_thr(make_server(job_max_attempts=max_attempts))
    url = server.url
    with server.store.use("thr", lambda: None):  # the job waits, claimed, for the busy model
        job = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        _wait(url, job["id"], ("running",))
        holder = sqlite3.connect(server.config.db_path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
    time.sleep(6.5)  # the worker's next write waits 5 s for the lock, then fails
    holder.execute("ROLLBACK")
    holder.close()
    done = _wait(url, job["id"], ("succeeded", "failed"))
    if max_attempts == 2:
        assert done["state"] == "succeeded" and done["attempts"] == 2, done  # put back, run again
    else:
        assert done["state"] == "failed" and done["error"] == (
            "the server could not record this job (its jobs database refused writes, or its worker failed), and "
            "the job has used its 1 attempt(s); not retried again"), done
        assert done["outputs"] == [] and done["segmented"] is None, done
        _gone(server.config.jobs_dir / job["id"])  # a failed job keeps no folder
    later = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
    assert _wait(url, later["id"], ("succeeded", "failed"))["state"] == "succeeded"
    refused = [r.getMessage() for r in caplog.records if r.name == "medserve.server.jobs" and r.levelname == "ERROR"]
    assert refused and refused[0].startswith(f"the job worker failed (OperationalError: database is locked) while "
                                             f"job {job['id']} ran")


@pytest.mark.parametrize("patience", [1800.0, -1.0], ids=["room-returns", "stays-full"])
def test_a_job_whose_result_finds_the_disk_full_waits_for_room_without_using_an_attempt(
        make_server, study: Path, patience: float, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A full disk while the SEG was written failed the job for good on its first attempt (the server's
    condition, not the job's). Now it goes back to the queue with its attempt given back, and fails only once the
    disk has stayed full past the patience."""
    from medserve.server import jobs as jobs_module

    monkeypatch.setattr(jobs_module, "DISK_FULL_PATIENCE_S", patience)
    server = with_thr(make_server(job_max_attempts=1))
    url = server.url
    with server.store.use("thr", lambda: None):  # the job waits, claimed, for the busy model
        job = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        _wait_for_stage(url, job["id"], "waiting for the model")  # past the attempt's clearing of result.tmp
        result_tmp = server.config.jobs_dir / job["id"] / "result.tmp"
        result_tmp.mkdir()
        # every write of the SEG there fails with ENOSPC, as on a full disk (its partial name is this process's)
        (result_tmp / f".seg.dcm.{os.getpid()}.partial.dcm").symlink_to("/dev/full")
    done = _wait(url, job["id"], ("succeeded", "failed"))
    if patience > 0:
        assert done["state"] == "succeeded" and done["attempts"] == 1, done
        warned = [r.getMessage() for r in caplog.records if r.name == "medserve.server.jobs"
                  and r.levelname == "WARNING"]
        assert any(m.startswith(f"job {job['id']} goes back to the queue, its attempt given back: the server's disk "
                                "is full") for m in warned), warned
        assert pydicom.dcmread(io.BytesIO(httpx.get(url + done["result_url"]).content)).Modality == "SEG"
    else:
        assert done["state"] == "failed", done
        assert re.fullmatch(r"the server's disk stayed full for \S+ minutes while this job ran; submit it again when "
                            r"there is room", done["error"]), done
        _gone(server.config.jobs_dir / job["id"])


def test_a_job_cancelled_as_its_result_finds_the_disk_full_leaves_no_input(
        make_server, study: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel that lands between the end of inference and the full disk: the job must not go back to the queue
    (it is cancelled), and its input, which only its worker drops, must not stay on the full disk."""
    from medserve.server import jobs as jobs_module

    def cancelled_then_full(queue: jobs_module.JobQueue, job_id: str, *args: object) -> dict[str, str]:
        queue.cancel(job_id)
        raise OSError(errno.ENOSPC, "No space left on device", "result.tmp/seg.dcm")

    monkeypatch.setattr(jobs_module.JobQueue, "_infer", cancelled_then_full)
    server = with_thr(make_server())
    job = httpx.post(server.url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
    assert _wait(server.url, job["id"], ("cancelled",))["attempts"] == 1
    _gone(server.config.jobs_dir / job["id"])
    time.sleep(1.5)  # the worker's wait after a full disk: it must not claim the job again
    assert httpx.get(f"{server.url}/v1/jobs/{job['id']}").json()["state"] == "cancelled"


def test_a_jobs_format_is_the_format_its_result_is_served_in(thr_server, study: Path, tmp_path: Path) -> None:
    """`format=nifti` on a job was checked and then dropped: the result came back as the SEG."""
    url = thr_server.url
    job = httpx.post(url + "/v1/jobs?model=thr&format=nifti", files=multipart_files(study)).json()
    assert job["format"] == "nifti", job
    assert _wait(url, job["id"], ("succeeded", "failed"))["state"] == "succeeded"
    result = httpx.get(f"{url}/v1/jobs/{job['id']}/result")
    assert result.headers["content-type"] == "application/gzip" and result.content[:2] == b"\x1f\x8b", result.headers
    assert httpx.get(f"{url}/v1/jobs/{job['id']}/result?format=seg").headers["content-type"] == "application/dicom"
    assert httpx.get(f"{url}/v1/jobs/{job['id']}/result",
                     headers={"Accept": "application/dicom"}).headers["content-type"] == "application/dicom"
    # A result without the asked format (a MAP's app may write the SEG only): 406 naming what it has, not the SEG
    with sqlite3.connect(thr_server.config.db_path) as db:
        db.execute("UPDATE jobs SET outputs=? WHERE id=?", ('{"seg": "seg.dcm"}', job["id"]))
    missing = httpx.get(f"{url}/v1/jobs/{job['id']}/result")
    assert (missing.status_code, missing.json()["error"]) == (406, "format_unavailable"), missing.text
    assert "has no nifti output (has ['seg'])" in missing.json()["message"], missing.text
    assert httpx.get(f"{url}/v1/jobs/{job['id']}/result?format=seg").status_code == 200
    plain = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
    assert plain["format"] is None and _wait(url, plain["id"], ("succeeded", "failed"))["state"] == "succeeded"
    assert httpx.get(f"{url}/v1/jobs/{plain['id']}/result").headers["content-type"] == "application/dicom"
    # A NIfTI input has no SEG to ask for: refused when submitted, as a sync request is
    nifti = tmp_path / "ct.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 4), np.float32), np.eye(4)), nifti)
    refused = httpx.post(url + "/v1/jobs?model=thr&format=seg",
                         files={"file": ("ct.nii.gz", nifti.read_bytes(), "application/gzip")})
    assert (refused.status_code, refused.json()["error"]) == (406, "format_unavailable"), refused.text


def test_finished_jobs_past_their_retention_are_removed_with_their_results(make_server, study: Path) -> None:
    """Without it the data dir only grew: a finished job cannot be deleted (DELETE cancels)."""
    server = with_thr(make_server(job_retention_seconds=3600.0))
    url, jobs = server.url, server.app.state.services.jobs
    done = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
    assert _wait(url, done["id"], ("succeeded", "failed"))["state"] == "succeeded"
    with server.store.use("thr", lambda: None):  # the next one waits, running, for the busy model
        running = httpx.post(url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
        _wait(url, running["id"], ("running",))
        assert jobs.sweep_finished() == 0  # ended just now
        assert jobs.sweep_finished(now=time.time() + 7200) == 1
    assert httpx.get(f"{url}/v1/jobs/{done['id']}").status_code == 404
    assert not (server.config.jobs_dir / done["id"]).exists()
    assert _wait(url, running["id"], ("succeeded", "failed"))["state"] == "succeeded"  # untouched while it ran


def test_without_a_retention_finished_jobs_are_kept(thr_server, study: Path) -> None:
    job = httpx.post(thr_server.url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
    assert _wait(thr_server.url, job["id"], ("succeeded", "failed"))["state"] == "succeeded"
    assert thr_server.app.state.services.jobs.sweep_finished(now=time.time() + 10 * 365 * 86400) == 0
    assert httpx.get(f"{thr_server.url}/v1/jobs/{job['id']}/result").status_code == 200


def test_a_job_cancelled_while_its_worker_waits_to_put_it_back_leaves_no_files(base_config, study: Path) -> None:
    """The worker had given up on the job (a refused write) when it was cancelled: no worker was left to remove
    its input and partial result."""
    from medserve.server.inputs import InputSpec
    from medserve.server.jobs import JobQueue
    from medserve.server.store import ModelStore

    store = ModelStore(base_config)
    jobs = JobQueue(base_config, store)
    try:
        folder = jobs.job_dir("a" * 32)
        shutil.copytree(study, folder / "input" / "dicom")
        jobs.submit("a" * 32, "thr", InputSpec("dicom", folder / "input" / "dicom"), False, None)
        assert jobs._claim()["id"] == "a" * 32
        (folder / "result.tmp").mkdir()
        jobs.cancel("a" * 32)
        jobs._put_back("a" * 32)
        assert jobs.get("a" * 32)["state"] == "cancelled"
        assert not folder.exists()
    finally:
        jobs.close()
        store.stop()


def test_a_worker_backs_off_at_most_30_s_however_long_the_database_refuses() -> None:
    """2.0 ** 1024 overflowed after about 8.5 hours of refusals, ending the worker."""
    from medserve.server.jobs import backoff_seconds

    assert [backoff_seconds(n) for n in (1, 2, 3, 5, 6, 1025, 10**6)] == [1, 2, 4, 16, 30, 30, 30]


def test_a_submission_the_jobs_database_cannot_record_is_a_503_to_retry(thr_server, study: Path) -> None:
    """Its lock held past sqlite's 5 s by another process: it was a 500 internal_error."""
    holder = sqlite3.connect(thr_server.config.db_path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        refused = httpx.post(thr_server.url + "/v1/jobs?model=thr", files=multipart_files(study), timeout=60)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert (refused.status_code, refused.json()["error"], refused.headers.get("Retry-After")) == (
        503, "database_busy", "5"), refused.text
    assert list(thr_server.config.jobs_dir.iterdir()) == []  # its input is not kept
    job = httpx.post(thr_server.url + "/v1/jobs?model=thr", files=multipart_files(study)).json()
    assert _wait(thr_server.url, job["id"], ("succeeded", "failed"))["state"] == "succeeded"


def test_the_retention_sweep_leaves_a_job_its_worker_still_holds(base_config, study: Path) -> None:
    """A job cancelled while it ran is finished, but its worker may still write into its folder."""
    from medserve.server.inputs import InputSpec
    from medserve.server.jobs import JobQueue
    from medserve.server.store import ModelStore

    config = replace(base_config, job_retention_seconds=60.0)
    store = ModelStore(config)
    jobs = JobQueue(config, store)
    try:
        job_id = "b" * 32
        shutil.copytree(study, jobs.job_dir(job_id) / "input" / "dicom")
        jobs.submit(job_id, "thr", InputSpec("dicom", jobs.job_dir(job_id) / "input" / "dicom"), False, None)
        jobs._claim()
        jobs._hold(job_id)
        jobs.cancel(job_id)
        later = time.time() + 3600
        assert jobs.sweep_finished(now=later) == 0 and jobs.job_dir(job_id).exists()
        jobs._release(job_id)
        assert jobs.sweep_finished(now=later) == 1 and not jobs.job_dir(job_id).exists()
    finally:
        jobs.close()
        store.stop()
