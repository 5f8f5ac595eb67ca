"""The FastAPI application: `create_app(config)` wires the store, job queue, uploads, OIP and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import FileResponse, JSONResponse, Response

from medserve.errors import MedserveError
from medserve.server import maps, oip, uploads
from medserve.server.accept import preferred_format
from medserve.server.auth import Authenticator, load_tokens, require
from medserve.server.config import ServerConfig
from medserve.server.errors import (ApiError, api_error_handler, core_error_handler, database_error_handler, from_core,
                                    http_error_handler, internal_error_handler, os_error_handler, shown,
                                    validation_error_handler)
from medserve.server.inputs import InputSpec, input_json, media_type, parse_input, request_options
from medserve.server.jobs import STATES, IdempotencyKeyTaken, JobQueue
from medserve.server.lock import UnusableDataDir, lock_data_dir
from medserve.server.metrics import Metrics, RequestCount
from medserve.server.runner import execute_async, pull
from medserve.server.store import ModelStore, check_model_name
from medserve.server.uploads import UploadStore

T = TypeVar("T")
log = logging.getLogger("medserve.server.app")

MEDIA = {"seg": "application/dicom", "nifti": "application/gzip"}
FILENAMES = {"seg": "seg.dcm", "nifti": "labels.nii.gz"}
MAX_JOBS_LISTED = 1000


def check_format(fmt: Any) -> str:
    if not isinstance(fmt, str) or fmt not in MEDIA:
        raise ApiError(400, "bad_format", f"format must be 'seg' or 'nifti', not {fmt!r}")
    return fmt


MODEL_ACTIONS = ("load", "unload", "infer")  # POST /v1/models/NAME/ACTION


def requested_format(options: dict[str, Any]) -> str | None:
    """The `?format=` or form/JSON field, checked: known before the study is read, so a bad one is refused first."""
    fmt = options.get("format")
    return None if fmt is None else check_format(fmt)


def choose_format(request: Request, options: dict[str, Any], spec: InputSpec) -> str:
    """`?format=` / form field wins, then Accept, then the natural output of the input (SEG for DICOM)."""
    fmt = requested_format(options) or preferred_format(request.headers.get("accept", ""), _formats_of(spec))
    _check_available(fmt, spec)
    return fmt


def _formats_of(spec: InputSpec) -> list[str]:
    return ["nifti"] if spec.kind == "nifti" else ["seg", "nifti"]


def _check_available(fmt: str, spec: InputSpec) -> None:
    if fmt not in _formats_of(spec):
        raise ApiError(406, "format_unavailable", "a NIfTI input can only produce a NIfTI label map")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def writeback_option(options: dict[str, Any]) -> bool:
    """`?writeback=` or the form/JSON field: a boolean (JSON) or one of the usual words; anything else is a 400
    rather than a silent "no"."""
    value = options.get("writeback", False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ApiError(400, "bad_parameter", f"writeback {value!r}: expected true or false")


async def remove_folder(folder: Path) -> None:
    """A request's folder removed off the event loop (100,000 parts took 0.9 s, every other request waiting),
    shielded: it runs on the way out of a cancelled request too."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(shutil.rmtree, folder, True)


async def unless_disconnected(request: Request, work: Awaitable[T],
                              on_gone: Callable[[], None] = lambda: None) -> T:
    """`work`, given up when the client goes away (checked twice a second): a client that timed out must not keep
    its place in the model's queue, nor have its study run. A run already in its thread goes on to its end (it
    cannot be interrupted), and its result is dropped; `on_gone()` tells a thread that can stop (a pull) to."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait({task}, timeout=0.5))[0]:
            if await request.is_disconnected():
                on_gone()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task  # its own failure, if any, is no one's concern now
                raise ApiError(499, "client_closed_request", "the client went away before the result was ready")
        return task.result()
    finally:
        if not task.done():  # the server is stopping
            on_gone()
            task.cancel()


async def pull_unless_disconnected(request: Request, config: ServerConfig, spec: InputSpec, work: Path) -> InputSpec:
    """A sync request's DICOMweb pull into `work`, stopped at its next bytes when the client goes away (or the
    server stops). Returns, or raises, only once the pull's thread has ended, so that the request's folder is not
    removed while the thread still writes into it."""
    gone, ended = threading.Event(), threading.Event()

    def stop_if_gone() -> None:
        if gone.is_set():
            raise ApiError(499, "client_closed_request", "the client went away during the pull")

    def pull_in_thread() -> InputSpec:
        try:
            return pull(config, spec, work, False, check=stop_if_gone)
        finally:
            ended.set()

    try:
        return await unless_disconnected(request, anyio.to_thread.run_sync(pull_in_thread), on_gone=gone.set)
    finally:
        if not ended.is_set():  # it stops at its next bytes, or when the store's silence times out
            gone.set()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(ended.wait, 2 * config.dicomweb_timeout + 5)


def idempotency_key(request: Request) -> str | None:
    """The Idempotency-Key header; an empty one (a client's unset variable) is no key, not one shared by all."""
    return (request.headers.get("idempotency-key") or "").strip() or None


def create_app(config: ServerConfig) -> FastAPI:
    """The app, with the data dir taken for this process (DataDirInUse when another server holds it) before
    anything in it is cleaned up or recovered; the lifespan's end gives it back."""
    data_lock = lock_data_dir(config.data_dir)
    jobs: JobQueue | None = None
    try:
        for folder in (config.data_dir, config.uploads_dir, config.jobs_dir, config.tmp_dir):
            folder.mkdir(parents=True, exist_ok=True)
        metrics = Metrics()
        store = ModelStore(config, on_change=metrics.store_changed)
        try:
            jobs = JobQueue(config, store, metrics)
        except sqlite3.DatabaseError as error:  # damaged, not a database, or read-only: before anything is removed
            remedy = ("make it writable" if "readonly" in str(error) else
                      "restore it, or move it and jobs/ away to start afresh")
            raise UnusableDataDir(f"{config.db_path}: cannot be used as the job database ({error}); {remedy}") \
                from error
        shutil.rmtree(config.tmp_dir, ignore_errors=True)  # sync-request scratch from a previous run
        config.tmp_dir.mkdir(parents=True, exist_ok=True)
        metrics.watch_jobs(jobs.counts)
        upload_store = UploadStore(config.uploads_dir, config.max_upload_bytes, config.upload_expiry_seconds,
                                   config.upload_idle_seconds)
        auth = Authenticator(load_tokens(config.tokens_file))
    except BaseException:  # a bad tokens file, say: leave the data dir free for the corrected retry
        if jobs is not None:
            jobs.close()
        data_lock.close()
        raise

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = None
        try:
            store.start()
            jobs.start()
            sweeper = asyncio.create_task(_sweep(upload_store, jobs))
            log.info("serving store %s, data in %s", config.store, config.data_dir)
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            try:
                jobs.stop()
                store.stop()
            finally:
                jobs.close()
                maps.stop_containers()  # after close: a job whose container ends now is requeued, not failed
                # A worker still in a forward pass may write into the data dir until it ends: no other server
                # may take the folder before then.
                jobs.when_workers_end(data_lock.close)

    app = FastAPI(title="medserve", version="0.1.0", lifespan=lifespan,
                  description="MONAI bundles served by folder name: DICOM in, DICOM SEG out.")
    app.state.config, app.state.store, app.state.jobs = config, store, jobs
    app.state.uploads, app.state.metrics, app.state.auth = upload_store, metrics, auth
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(MedserveError, core_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(OSError, os_error_handler)
    app.add_exception_handler(sqlite3.Error, database_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.include_router(uploads.router)
    app.add_middleware(uploads.TusProtocol)
    app.include_router(oip.router)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz() -> JSONResponse:
        ready = store.ready.is_set()
        models = {e.name: e.state for e in store.entries()}
        return JSONResponse({"ready": ready, "models": models}, 200 if ready else 503)

    @app.get("/metrics", tags=["health"])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", tags=["models"], dependencies=[Depends(require("admin"))])
    async def list_models() -> dict[str, Any]:
        return {"models": [e.summary() for e in store.entries()]}

    @app.get("/v1/models/{name:path}", tags=["models"], dependencies=[Depends(require("admin"))])
    async def show_model(name: str, request: Request) -> dict[str, Any]:
        model, _, action = name.rpartition("/")
        if model and action in MODEL_ACTIONS:  # the path parameter would take `NAME/infer` as a model name
            raise ApiError(405, "method_not_allowed", f"Method Not Allowed: GET {request.url.path} (use POST)",
                           {"Allow": "POST"})
        return store.entry(name).summary()

    @app.post("/v1/models/{name:path}/load", tags=["models"], dependencies=[Depends(require("admin"))])
    async def load_model(name: str) -> dict[str, Any]:
        store.entry(name)
        await anyio.to_thread.run_sync(store.predictor, name)
        return store.entry(name).summary()

    @app.post("/v1/models/{name:path}/unload", tags=["models"], dependencies=[Depends(require("admin"))])
    async def unload_model(name: str) -> dict[str, Any]:
        store.unload(name)
        return store.entry(name).summary()

    @app.post("/v1/models/{name:path}/infer", tags=["inference"], dependencies=[Depends(require("infer"))],
              responses={200: {"content": {"application/dicom": {}, "application/gzip": {}}}})
    async def infer(name: str, request: Request) -> Response:
        """Synchronous study inference; the body is DICOM files (multipart), a zip, a NIfTI file, or JSON
        `{"upload": ID}` / `{"study": UID, "series": UID}`. Returns the SEG (or NIfTI with ?format=nifti)."""
        work = config.tmp_dir / uuid.uuid4().hex
        start = time.monotonic()

        def options_of_this_model(options: dict[str, Any]) -> None:
            requested_format(options)
            if "model" in options and options["model"] != name:
                raise ApiError(400, "bad_parameter", f"'model' is given as {shown(options['model'])} beside the "
                               f"model {name!r} this request is sent to; give it once")

        with metrics.counted("v1") as count:
            try:
                store.entry(name)  # unknown or malformed names fail before anything is read
                count.model = name
                spec, options = await parse_input(request, work / "input", config.max_upload_bytes,
                                                  options_of_this_model)
                fmt = choose_format(request, options, spec)
                if writeback_option(options):
                    raise ApiError(400, "bad_parameter", "writeback applies to jobs (POST /v1/jobs), which store the "
                                   "SEG back; a sync request returns it")
                if spec.kind == "dicomweb":
                    spec = await pull_unless_disconnected(request, config, spec, work)
                outcome = await unless_disconnected(request, execute_async(store, name, spec, work / "out",
                                                                           nifti=fmt == "nifti"))
                result = outcome.result
                path = result.seg_path if fmt == "seg" else result.nifti_path
                if path is None:  # a MAP's app may write only the SEG
                    raise ApiError(406, "format_unavailable", f"model {name!r} produced no {fmt} output; ask for "
                                   f"{'nifti' if fmt == 'seg' else 'seg'}")
                count.status = "200"
            except MedserveError as error:
                raise from_core(error, work / "input" / "dicom", work / "input", work) from error
            finally:
                if count.status != "200":
                    await remove_folder(work)
        metrics.latency.labels(name, "v1").observe(time.monotonic() - start)
        metrics.queue.labels(name).observe(outcome.queued_s)
        headers = {"X-Medserve-Timings": json.dumps({k: round(v, 4) for k, v in outcome.timings.items()}),
                   "X-Medserve-Segments": json.dumps(result.segments, default=int)}
        for uid, header in ((result.study_uid, "X-Medserve-Study-UID"), (result.series_uid, "X-Medserve-Series-UID")):
            if uid:
                headers[header] = uid
        return FileResponse(path, media_type=MEDIA[fmt], filename=FILENAMES[fmt], headers=headers,
                            background=BackgroundTask(shutil.rmtree, work, True))

    @app.post("/v1/jobs", tags=["jobs"], status_code=202, dependencies=[Depends(require("infer"))])
    async def create_job(request: Request) -> JSONResponse:
        """Async inference: `?model=NAME` (or form/JSON field `model`), same inputs as /infer; 202 + job."""
        with metrics.counted("jobs") as count:
            response = await _create_job(request, count)
            count.status = str(response.status_code)
            return response

    async def _create_job(request: Request, count: RequestCount) -> JSONResponse:
        key = idempotency_key(request)
        existing = jobs.find_idempotent(key) if key else None
        named = request.query_params.get("model")

        def job_model(options: dict[str, Any]) -> str:
            """The model the request names, checked before its study is read (a big one takes a while)."""
            model = options.get("model")
            if model is None or model == "":  # false or 0 are no names: check_model_name says so
                raise ApiError(400, "no_model", "the 'model' field is missing: name the model with "
                               "POST /v1/jobs?model=NAME or a 'model' field in the form or JSON body")
            check_model_name(model)
            if existing is None:  # a replay is answered even if its model has left the store since
                store.entry(model)
            if existing is None or existing["model"] == model:  # a name known to the store (or once)
                count.model = model
            requested_format(options)  # before the study is read; the job keeps it as its result's format
            return model

        if named:
            job_model(request_options(request))
        if existing is not None and media_type(request) == "application/json":
            # A replay of {"upload": ID}: no need to extract that upload again (a big study takes a while), nor for
            # it to exist still. Bodies that carry the study itself are read in full as usual.
            return _replayed(existing, job_model(request_options(request, (await input_json(request)).items())))
        job_id = jobs.new_id()
        folder = jobs.job_dir(job_id)
        try:
            spec, options = await parse_input(request, folder / "input", config.max_upload_bytes, job_model)
            model = job_model(options)
            if existing is not None:
                await remove_folder(folder)
                return _replayed(existing, model)
            writeback = writeback_option(options)
            if writeback and spec.kind != "dicomweb":
                raise ApiError(400, "writeback_needs_dicomweb", "writeback only applies to DICOMweb inputs")
            result_format = requested_format(options)
            if result_format is not None:
                _check_available(result_format, spec)
            try:
                job = jobs.submit(job_id, model, spec, writeback, key, result_format)
            except IdempotencyKeyTaken as taken:  # the same key's other request won the race: answer as a replay
                return _replayed(taken.job, model)
        except BaseException:
            await remove_folder(folder)
            raise
        return JSONResponse(job, 202, headers={"Location": f"/v1/jobs/{job_id}"})

    def _replayed(existing: dict[str, Any], model: str) -> JSONResponse:
        """The job an Idempotency-Key names, when it was for the same model (else 409)."""
        if existing["model"] != model:
            raise ApiError(409, "idempotency_conflict", f"Idempotency-Key was used for a job on {existing['model']!r}")
        return JSONResponse(existing, 200, headers={"Location": f"/v1/jobs/{existing['id']}",
                                                    "Idempotent-Replayed": "true"})

    @app.get("/v1/jobs", tags=["jobs"], dependencies=[Depends(require("infer"))])
    async def list_jobs(state: str | None = None, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        """Newest first; `offset` pages on (with `limit` at most 1000 a page, older jobs were out of reach)."""
        if state is not None and state not in STATES:
            raise ApiError(400, "bad_parameter", f"state {state!r} is not one of {', '.join(STATES)}")
        if not 1 <= limit <= MAX_JOBS_LISTED:
            raise ApiError(400, "bad_parameter", f"limit {limit} is not between 1 and {MAX_JOBS_LISTED}")
        if offset < 0:
            raise ApiError(400, "bad_parameter", f"offset {offset} is negative; expected 0 or more")
        return {"jobs": jobs.list(state, limit, offset)}

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], dependencies=[Depends(require("infer"))])
    async def get_job(job_id: str) -> dict[str, Any]:
        return jobs.get(job_id)

    @app.get("/v1/jobs/{job_id}/result", tags=["jobs"], dependencies=[Depends(require("infer"))])
    async def job_result(job_id: str, request: Request, format: str | None = None) -> FileResponse:
        if format is not None:
            check_format(format)
        path, fmt = jobs.result_path(job_id, lambda available: format or preferred_format(
            request.headers.get("accept", ""), available))
        return FileResponse(path, media_type=MEDIA[fmt], filename=FILENAMES[fmt])

    @app.delete("/v1/jobs/{job_id}", tags=["jobs"], dependencies=[Depends(require("infer"))])
    async def cancel_job(job_id: str) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(jobs.cancel, job_id)  # a MAP job's container is removed meanwhile

    return app


async def _sweep(upload_store: UploadStore, jobs: JobQueue) -> None:
    """Expired tus uploads (the expiration extension) and finished jobs past their retention go away in the
    background."""
    while True:
        await asyncio.sleep(60)
        with contextlib.suppress(Exception):
            gone = await anyio.to_thread.run_sync(upload_store.sweep)
            if gone:
                log.info("removed %d expired uploads", gone)
        with contextlib.suppress(Exception):
            gone = await anyio.to_thread.run_sync(jobs.sweep_finished)
            if gone:
                log.info("removed %d finished jobs past their retention", gone)
