"""Cross-origin access for browser apps (an OHIF viewer, Uppy or tus-js-client on another origin), off unless
origins are given (`--cors-origin`). A browser hides every response header outside the CORS safelist unless it
is exposed, and tus clients read Location and Upload-Offset: without them an upload cannot go on."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

METHODS = ("GET", "HEAD", "POST", "PATCH", "DELETE", "OPTIONS")
# Named one by one: a wildcard does not cover Authorization (Fetch standard).
REQUEST_HEADERS = ("Authorization", "Content-Type", "Accept", "Idempotency-Key", "Tus-Resumable", "Upload-Length",
                   "Upload-Offset", "Upload-Metadata", "Upload-Checksum", "Upload-Defer-Length", "Upload-Concat",
                   "X-HTTP-Method-Override", "X-Requested-With", "X-Request-ID", "Inference-Header-Content-Length")
EXPOSED_HEADERS = ("Location", "Retry-After", "WWW-Authenticate", "Content-Disposition", "Idempotent-Replayed",
                   "Tus-Resumable", "Tus-Version", "Tus-Extension", "Tus-Max-Size", "Tus-Checksum-Algorithm",
                   "Upload-Offset", "Upload-Length", "Upload-Expires", "Upload-Metadata",
                   "X-Medserve-Timings", "X-Medserve-Segments", "X-Medserve-Study-UID", "X-Medserve-Series-UID",
                   "Inference-Header-Content-Length")
PREFLIGHT_MAX_AGE_S = 600
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*|\[[0-9a-f:.]+\]")


def origin_problem(origin: str) -> str | None:
    """Why `origin` cannot be a CORS origin (None when it can): `*`, or the exact text a browser sends in its
    Origin header (lower case, no default port, nothing after the host), since origins are compared as text."""
    if origin == "*":
        return None
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError as error:
        return f"{origin!r} is not a URL ({error})"
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if scheme not in _DEFAULT_PORTS or not _HOST.fullmatch(host if ":" not in host else f"[{host}]"):
        return f"{origin!r} is not an origin: expected http(s)://host[:port], such as https://viewer.example.org"
    as_sent = f"{scheme}://{f'[{host}]' if ':' in host else host}"
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        as_sent += f":{port}"
    if origin != as_sent:
        return f"{origin!r} is not an origin as a browser sends it (it would never match); give {as_sent}"
    return None


def allow_origins(app: FastAPI, origins: list[str]) -> None:
    """Answer preflights and mark answers for `origins` (outside our routes and error handlers, so a 401 or a 429 is
    readable too; a 500, answered by Starlette's outermost error middleware, is not)."""
    # Private network access: a viewer served from a public origin may call a server on the hospital's network.
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=METHODS, allow_headers=REQUEST_HEADERS,
                       expose_headers=EXPOSED_HEADERS, max_age=PREFLIGHT_MAX_AGE_S, allow_private_network=True)
