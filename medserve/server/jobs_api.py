"""/v1/jobs: asynchronous study inference (submit, list, show, fetch the result, cancel); a job outlives the
request and the server's restarts (`medserve.server.jobs`)."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from starlette.responses import FileResponse, JSONResponse

from medserve.results import RESULT_FILES, RESULT_MEDIA
from medserve.server.accept import preferred_format
from medserve.server.auth import require
from medserve.server.errors import ApiError
from medserve.server.inputs import input_json, media_type, parse_input, remove_folder, request_options
from medserve.server.jobs import IdempotencyKeyTaken
from medserve.server.metrics import RequestCount
from medserve.server.options import check_available, check_format, requested_format, writeback_option
from medserve.server.services import services
from medserve.server.states import JOB_STATES
from medserve.server.store import check_model_name

MAX_JOBS_LISTED = 1000

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require("infer"))])


def idempotency_key(request: Request) -> str | None:
    """The Idempotency-Key header; an empty one (a client's unset variable) is no key, not one shared by all."""
    return (request.headers.get("idempotency-key") or "").strip() or None


@router.post("", status_code=202)
async def create_job(request: Request) -> JSONResponse:
    """Async inference: `?model=NAME` (or form/JSON field `model`), same inputs as /infer; 202 + job."""
    with services(request).metrics.counted("jobs") as count:
        response = await _create_job(request, count)
        count.status = str(response.status_code)
        return response


async def _create_job(request: Request, count: RequestCount) -> JSONResponse:
    shared = services(request)
    jobs, store = shared.jobs, shared.store
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
        spec, options = await parse_input(request, folder / "input", shared.config.max_upload_bytes, job_model)
        model = job_model(options)
        if existing is not None:
            await remove_folder(folder)
            return _replayed(existing, model)
        writeback = writeback_option(options)
        if writeback and spec.kind != "dicomweb":
            raise ApiError(400, "writeback_needs_dicomweb", "writeback only applies to DICOMweb inputs")
        result_format = requested_format(options)
        if result_format is not None:
            check_available(result_format, spec)
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


@router.get("")
async def list_jobs(request: Request, state: str | None = None, limit: int = 100, offset: int = 0) -> dict[str, Any]:
    """Newest first; `offset` pages on (with `limit` at most 1000 a page, older jobs were out of reach)."""
    if state is not None and state not in JOB_STATES:
        raise ApiError(400, "bad_parameter", f"state {state!r} is not one of {', '.join(JOB_STATES)}")
    if not 1 <= limit <= MAX_JOBS_LISTED:
        raise ApiError(400, "bad_parameter", f"limit {limit} is not between 1 and {MAX_JOBS_LISTED}")
    if offset < 0:
        raise ApiError(400, "bad_parameter", f"offset {offset} is negative; expected 0 or more")
    return {"jobs": services(request).jobs.list(state, limit, offset)}


@router.get("/{job_id}")
async def get_job(job_id: str, request: Request) -> dict[str, Any]:
    return services(request).jobs.get(job_id)


@router.get("/{job_id}/result")
async def job_result(job_id: str, request: Request, format: str | None = None) -> FileResponse:
    if format is not None:
        check_format(format)
    path, fmt = services(request).jobs.result_path(job_id, lambda available: format or preferred_format(
        request.headers.get("accept", ""), available))
    return FileResponse(path, media_type=RESULT_MEDIA[fmt], filename=RESULT_FILES[fmt])


@router.delete("/{job_id}")
async def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
    # In a thread: a MAP job's container is removed meanwhile.
    return await anyio.to_thread.run_sync(services(request).jobs.cancel, job_id)
