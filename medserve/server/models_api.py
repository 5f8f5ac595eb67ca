"""/v1/models: the store's models (list, show, load, unload) and synchronous study inference by model name."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
from fastapi import APIRouter, Depends, Request
from starlette.background import BackgroundTask
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.responses import FileResponse, Response

from medserve.errors import MedserveError
from medserve.results import RESULT_FILES, RESULT_MEDIA
from medserve.server.auth import require
from medserve.server.config import ServerConfig
from medserve.server.errors import ApiError, from_core, shown
from medserve.server.inputs import InputSpec, parse_input, remove_folder
from medserve.server.options import choose_format, requested_format, writeback_option
from medserve.server.runner import execute_async, pull
from medserve.server.services import services

T = TypeVar("T")


class ModelPathConvertor(PathConvertor):
    """A model's path, which may hold what no model name holds (check_model_name refuses it with a 400 naming
    the rule, not a 404), but does not end in an action: `GET NAME/infer` is not a model called `NAME/infer`, but
    the POST-only route (a 405 whose Allow says POST)."""

    regex = ".+(?<!/load)(?<!/unload)(?<!/infer)"


register_url_convertor("model_path", ModelPathConvertor())
router = APIRouter(prefix="/v1/models")
ADMIN_ONLY = [Depends(require("admin"))]


@router.get("", tags=["models"], dependencies=ADMIN_ONLY)
async def list_models(request: Request) -> dict[str, Any]:
    return {"models": [e.summary() for e in services(request).store.entries()]}


@router.get("/{name:model_path}", tags=["models"], dependencies=ADMIN_ONLY)
async def show_model(name: str, request: Request) -> dict[str, Any]:
    return services(request).store.entry(name).summary()


@router.post("/{name:path}/load", tags=["models"], dependencies=ADMIN_ONLY)
async def load_model(name: str, request: Request) -> dict[str, Any]:
    store = services(request).store
    store.entry(name)
    await anyio.to_thread.run_sync(store.predictor, name)
    return store.entry(name).summary()


@router.post("/{name:path}/unload", tags=["models"], dependencies=ADMIN_ONLY)
async def unload_model(name: str, request: Request) -> dict[str, Any]:
    store = services(request).store
    store.unload(name)
    return store.entry(name).summary()


@router.post("/{name:path}/infer", tags=["inference"], dependencies=[Depends(require("infer"))],
             responses={200: {"content": {"application/dicom": {}, "application/gzip": {}}}})
async def infer(name: str, request: Request) -> Response:
    """Synchronous study inference; the body is DICOM files (multipart), a zip, a NIfTI file, or JSON
    `{"upload": ID}` / `{"study": UID, "series": UID}`. Returns the SEG (or NIfTI with ?format=nifti)."""
    shared = services(request)
    config, store, metrics = shared.config, shared.store, shared.metrics
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
    return FileResponse(path, media_type=RESULT_MEDIA[fmt], filename=RESULT_FILES[fmt], headers=headers,
                        background=BackgroundTask(remove_folder, work))


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
