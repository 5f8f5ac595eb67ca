"""HTTP errors as JSON: `{"error": CODE, "message": TEXT}` with the right status, for every failure a client
can cause or meet (bad input, unknown model, full queue, DICOM store down)."""

from __future__ import annotations

import errno
import logging
import re
import sqlite3
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match

from medserve.errors import (BundleError, DicomInputError, InferenceError, InferenceOutOfMemory, MedserveError,
                             NiftiInputError, OutputError, SelectionError, VolumeError)

log = logging.getLogger("medserve.server.errors")


class ApiError(Exception):
    """An error with a status, a stable machine-readable code and a human message."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.code, "message": self.message}, self.status, headers=self.headers)


# Core errors are caused by the input (or by a bundle the operator dropped in); map each to a 4xx, except running
# out of memory, which the same request may not meet later (503), and failing to write results into the server's
# own data folder (500). The first matching class wins.
_CORE_CODES: list[tuple[type[MedserveError], int, str]] = [
    (DicomInputError, 400, "bad_dicom"),
    (NiftiInputError, 400, "bad_nifti"),
    (SelectionError, 422, "no_matching_series"),
    (VolumeError, 422, "bad_volume"),
    (InferenceOutOfMemory, 503, "out_of_memory"),
    (InferenceError, 422, "inference_failed"),
    (BundleError, 409, "model_failed"),
    (OutputError, 500, "output_failed"),
]


def shown(value: object, limit: int = 100) -> str:
    """`value` as its repr for a message, cut to `limit` characters: a 100,000-character name a client sent is
    not sent back whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def header_int(text: str | None) -> int | None:
    """A non-negative integer header value, or None. Only ASCII digits: str.isdigit() also accepts '²'; and at
    most 19 of them (any byte count fits), since int() refuses over 4,300 digits with a ValueError."""
    if text is None or not text.isascii() or not text.isdigit() or len(text.lstrip("0")) > 19:
        return None
    return int(text)


def client_message(error: MedserveError | str, *folders: Path) -> str:
    """The core's message with the server's own `folders` left out (most specific first), so that a file is
    named by its path in what the client sent, and the data folder's layout is not shown."""
    message = str(error)
    for folder in folders:  # whole path components only: ".../input/dicom" is no part of ".../input/dicom_x.nii"
        message = re.sub(re.escape(str(folder)) + r"(/|(?![\w-]|\.[\w.-]))", lambda m: "" if m.group(1) else ".",
                         message)
    return message


def from_core(error: MedserveError, *folders: Path) -> ApiError:
    """The API error for a core error; `folders`: see `client_message`. A result the server's full disk could not
    hold is 507, for the client to retry (not the 500 of a fault)."""
    if isinstance(error, OutputError) and for_want_of_room(error):
        return insufficient_storage("the result")
    message = client_message(error, *folders)
    for kind, status, code in _CORE_CODES:
        if isinstance(error, kind):
            return ApiError(status, code, message)
    return ApiError(400, "bad_input", message)


def _shaped(request: Request, error: ApiError) -> JSONResponse:
    """The error in the shape the route's protocol uses: the Open Inference Protocol's `{"error": TEXT}` under
    /v2 (what tritonclient reads; auth and routing errors there too), ours everywhere else."""
    if request.url.path == "/v2" or request.url.path.startswith("/v2/"):
        return JSONResponse({"error": error.message}, error.status, headers=error.headers)
    return error.response()


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _shaped(request, exc)


async def core_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, MedserveError)
    log.info("input error on %s: %s", request.url.path, exc)
    return _shaped(request, from_core(exc))


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's checks of query/path parameters (e.g. `?limit=abc`), in our shape rather than {"detail": [...]}."""
    assert isinstance(exc, RequestValidationError)
    problems = "; ".join(f"{' '.join(str(part) for part in error['loc'])}: {error['msg']}" for error in exc.errors())
    return _shaped(request, ApiError(400, "bad_parameter", problems))


async def http_error_handler(request: Request, exc: Exception, routes: Sequence[BaseRoute] = ()) -> JSONResponse:
    """Starlette's own errors (unknown route 404, wrong method 405), in our shape. A 405's Allow lists what every
    one of `routes` at the path takes: routing names only the first route it matched (an upload's OPTIONS, of
    its OPTIONS, HEAD, GET, PATCH and DELETE routes)."""
    assert isinstance(exc, HTTPException)
    code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
    message = f"{exc.detail}: {request.method} {request.url.path}"
    headers = dict(exc.headers or {})
    methods = {method for route in routes if route.matches(request.scope)[0] is not Match.NONE
               for method in getattr(route, "methods", None) or ()} if exc.status_code == 405 else set()
    if methods:
        headers["Allow"] = ", ".join(sorted(methods))
    return _shaped(request, ApiError(exc.status_code, code, message, headers))


def disk_full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT)


def for_want_of_room(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a full disk or quota (507, ENOSPC, EDQUOT)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and disk_full(seen) or isinstance(seen, ApiError) and seen.status == 507:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def insufficient_storage(what: str, headers: dict[str, str] | None = None) -> ApiError:
    """The server's disk is full (or its quota used up) while it stores `what`: the client may retry later."""
    return ApiError(507, "insufficient_storage", f"the server has no room left for {what}; retry later",
                    {"Retry-After": "60", **(headers or {})})


async def os_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """An OSError no route turned into an answer. A full disk while a body, part or upload chunk is stored is a
    507 the client can act on; anything else is ours, answered as `internal_error_handler` answers it. Being
    answered here rather than by Starlette's outermost handler, it passes the middlewares (tus adds its
    Tus-Resumable header)."""
    assert isinstance(exc, OSError)
    if disk_full(exc):
        log.error("no room left on the server's disk on %s %s: %s", request.method, request.url.path, exc)
        return _shaped(request, insufficient_storage("this request"))
    return await _answered_as_ours(request, exc)


async def database_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """The jobs database refusing a request's write: its disk full (507), or its lock held past sqlite's wait by
    another process (503); both pass. Anything else is ours, as in `internal_error_handler`."""
    assert isinstance(exc, sqlite3.Error)
    code = getattr(exc, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_FULL:
        log.error("no room left for the jobs database on %s %s: %s", request.method, request.url.path, exc)
        return _shaped(request, insufficient_storage("this request"))
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        log.error("the jobs database is locked on %s %s: %s", request.method, request.url.path, exc)
        return _shaped(request, ApiError(503, "database_busy", "the server's jobs database is busy; retry later",
                                         {"Retry-After": "5"}))
    return await _answered_as_ours(request, exc)


async def _answered_as_ours(request: Request, exc: Exception) -> JSONResponse:
    """A handler's exception that is a fault of ours after all: logged with its traceback here, since Starlette
    raises on only what its outermost handler answers, then answered as `internal_error_handler` does."""
    log.error("the server failed on %s %s", request.method, request.url.path, exc_info=exc)
    return await internal_error_handler(request, exc)


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Anything else (a bug, or a library failing in a way we did not foresee): answered in our shape rather than
    Starlette's plain-text 500, without internals in the message. Starlette raises it on after this answer, so
    the server logs it with its traceback."""
    return _shaped(request, ApiError(500, "internal_error", f"the server failed on {request.method} "
                                     f"{request.url.path} ({type(exc).__name__}); its log has the details"))
