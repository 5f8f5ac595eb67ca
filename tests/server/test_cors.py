"""Browser apps on another origin (`--cors-origin`): preflights answered, and the headers tus clients read
(Location, Upload-Offset) exposed, on errors too."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from medserve.server.cors import origin_problem
from tests.server.conftest import REPO, free_port

VIEWER = "https://viewer.example.org"
TUS = {"Tus-Resumable": "1.0.0"}


def _exposed(response: httpx.Response) -> set[str]:
    return {name.strip().lower() for name in response.headers.get("access-control-expose-headers", "").split(",")}


def test_a_browser_app_on_an_allowed_origin_can_upload_and_read_what_tus_needs(make_server) -> None:
    server = make_server(cors_origins=[VIEWER])
    preflight = httpx.options(server.url + "/v1/uploads", headers={
        "Origin": VIEWER, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, tus-resumable, upload-length, upload-metadata"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == VIEWER
    allowed = {h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "tus-resumable", "upload-length", "upload-metadata", "upload-offset"} <= allowed
    assert "PATCH" in preflight.headers["access-control-allow-methods"]
    from_public_page = httpx.options(server.url + "/v1/uploads", headers={  # tus-js-client with addRequestId
        "Origin": VIEWER, "Access-Control-Request-Method": "PATCH", "Access-Control-Request-Private-Network": "true",
        "Access-Control-Request-Headers": "x-request-id, upload-offset, content-type"})
    assert from_public_page.status_code == 200, from_public_page.text
    assert from_public_page.headers["access-control-allow-private-network"] == "true"
    created = httpx.post(server.url + "/v1/uploads", headers={**TUS, "Origin": VIEWER, "Upload-Length": "3"})
    assert created.status_code == 201 and created.headers["access-control-allow-origin"] == VIEWER
    assert {"location", "upload-offset", "upload-expires", "tus-resumable"} <= _exposed(created)
    patched = httpx.patch(created.headers["Location"], content=b"abc", headers={
        **TUS, "Origin": VIEWER, "Upload-Offset": "0", "Content-Type": "application/offset+octet-stream"})
    assert patched.status_code == 204 and "upload-offset" in _exposed(patched)
    refused = httpx.get(server.url + "/v1/models/nothing/", headers={"Origin": VIEWER})  # an error is readable too
    assert refused.status_code >= 400 and refused.headers["access-control-allow-origin"] == VIEWER


def test_other_origins_and_servers_without_origins_allow_no_one(make_server, tmp_path) -> None:
    server = make_server(cors_origins=[VIEWER])
    elsewhere = httpx.get(server.url + "/healthz", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in elsewhere.headers
    preflight = httpx.options(server.url + "/v1/uploads", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 400 and "access-control-allow-origin" not in preflight.headers
    plain = make_server(data_dir=tmp_path / "plain", port=free_port())
    assert "access-control-allow-origin" not in httpx.get(plain.url + "/healthz", headers={"Origin": VIEWER}).headers
    tus_options = httpx.options(plain.url + "/v1/uploads", headers={"Origin": VIEWER, **TUS})
    assert tus_options.status_code == 204 and tus_options.headers["Tus-Version"] == "1.0.0"


@pytest.mark.parametrize("origin, problem", [
    ("https://viewer.example.org/", "give https://viewer.example.org"),
    ("https://user:pw@viewer.example.org", "give https://viewer.example.org"),
    ("viewer.example.org", "expected http(s)://host[:port]"),
    ("http://viewer:port", "is not a URL"),
    ("https://Viewer.Example.org", "give https://viewer.example.org"),  # browsers send it lower-cased
    ("https://viewer.example.org:443", "give https://viewer.example.org"),  # and without the default port
    ("http://*.example.org", "expected http(s)://host[:port]"),  # origins are compared as text: no wildcards
])
def test_an_origin_no_browser_sends_is_refused_at_start(origin: str, problem: str) -> None:
    assert problem in (origin_problem(origin) or "")
    run = subprocess.run([sys.executable, "-m", "medserve.cli", "serve", "--cors-origin", origin], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith(
        "medserve serve: error: argument --cors-origin: "), run.stderr


def test_origins_as_browsers_send_them_are_taken() -> None:
    for origin in ("*", "http://127.0.0.1:3000", "https://viewer.example.org", "http://[::1]:8080"):
        assert origin_problem(origin) is None, origin
