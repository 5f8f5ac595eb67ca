"""Cross-origin access for browser apps (an OHIF viewer, Uppy or tus-js-client on another origin), off unless
origins are given (`--cors-origin`). A browser hides every response header outside the CORS safelist unless it
is exposed, and tus clients read Location and Upload-Offset: without them an upload cannot go on."""

from __future__ import annotations

from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

METHODS = ("GET", "HEAD", "POST", "PATCH", "DELETE", "OPTIONS")
# Named one by one: a wildcard does not cover Authorization (Fetch standard).
REQUEST_HEADERS = ("Authorization", "Content-Type", "Accept", "Idempotency-Key", "Tus-Resumable", "Upload-Length",
                   "Upload-Offset", "Upload-Metadata", "Upload-Checksum", "X-HTTP-Method-Override",
                   "X-Requested-With", "Inference-Header-Content-Length")
EXPOSED_HEADERS = ("Location", "Retry-After", "WWW-Authenticate", "Content-Disposition", "Idempotent-Replayed",
                   "Tus-Resumable", "Tus-Version", "Tus-Extension", "Tus-Max-Size", "Tus-Checksum-Algorithm",
                   "Upload-Offset", "Upload-Length", "Upload-Expires", "Upload-Metadata",
                   "X-Medserve-Timings", "X-Medserve-Segments", "X-Medserve-Study-UID", "X-Medserve-Series-UID",
                   "Inference-Header-Content-Length")
PREFLIGHT_MAX_AGE_S = 600


def origin_problem(origin: str) -> str | None:
    """Why `origin` cannot be a CORS origin (None when it can): `*`, or scheme://host[:port] as a browser sends
    it in its Origin header, with no path, query or trailing slash (which would never match)."""
    if origin == "*":
        return None
    try:
        parts = urlsplit(origin)
        parts.port  # noqa: B018 - raises ValueError on a port that is no number
    except ValueError as error:
        return f"{origin!r} is not a URL ({error})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{origin!r} is not an origin: expected http(s)://host[:port], such as https://viewer.example.org"
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        return (f"{origin!r} is not an origin: a browser sends scheme://host[:port] only; give "
                f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}")
    return None


def allow_origins(app: FastAPI, origins: list[str]) -> None:
    """Answer preflights and mark answers for `origins` (outermost middleware: a 401 or a 429 is readable too)."""
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=METHODS, allow_headers=REQUEST_HEADERS,
                       expose_headers=EXPOSED_HEADERS, max_age=PREFLIGHT_MAX_AGE_S)
