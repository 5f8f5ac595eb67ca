"""Fixtures for the server tests: real HTTP on 127.0.0.1 (uvicorn in a thread, or `medserve serve` as a
subprocess where a crash is part of the test), the real demo bundle copied into a temporary store, the demo
study and small CT studies written by medserve.demo."""

from __future__ import annotations

import http.server
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pydicom
import pytest
import uvicorn

from medserve.server.app import Server, create_app
from medserve.server.config import ServerConfig
from tests.conftest import make_threshold_bundle

REPO = Path(__file__).resolve().parents[2]
DEMO_BUNDLE = REPO / "bundles" / "demo_organ_seg"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0, path: str = "/readyz") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} not ready after {timeout} s")


class ServerThread:
    """create_app + uvicorn.Server in a background thread of the test process."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.app = create_app(config)
        self.server = Server(uvicorn.Config(self.app, host="127.0.0.1", port=config.port, log_level="warning",
                                            lifespan="on"), self.app.state.services.uploads)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{config.port}"

    @property
    def store(self):  # noqa: ANN201
        return self.app.state.services.store

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_http(self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


class ServerProcess:
    """`medserve serve` as a child process (killable with SIGKILL)."""

    def __init__(self, args: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.args = [sys.executable, "-m", "medserve.cli", "serve", "--port", str(port), *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> ServerProcess:
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     cwd=REPO)
        try:
            wait_http(self.url, timeout)
        except TimeoutError:
            self.kill()
            out = self.proc.stdout.read().decode() if self.proc.stdout else ""
            raise TimeoutError(f"server did not start: {out[-3000:]}") from None
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=20)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    store.mkdir()
    return store


_SNAPSHOT: list[Path] = []


def bundle_snapshot() -> Path:
    """One copy of the demo bundle per test session, so that the tests never see it half-rewritten (e.g. by
    `make train-demo` running beside them)."""
    if not _SNAPSHOT:
        import atexit
        import tempfile

        target = Path(tempfile.mkdtemp(prefix="medserve-bundle-")) / "demo_organ_seg"
        atexit.register(shutil.rmtree, target.parent, True)
        shutil.copytree(DEMO_BUNDLE, target)
        _SNAPSHOT.append(target)
    return _SNAPSHOT[0]


def add_bundle(store: Path, name: str = "demo", source: Path | None = None) -> Path:
    target = store / name
    shutil.copytree(source or bundle_snapshot(), target)
    return target


@pytest.fixture
def base_config(tmp_path: Path, store_dir: Path) -> ServerConfig:
    return ServerConfig(store=store_dir, data_dir=tmp_path / "data", port=free_port(), poll_interval=0.2,
                        stable_seconds=0.6, device="cpu")


@pytest.fixture
def make_server(base_config: ServerConfig) -> Iterator:
    started: list[ServerThread] = []

    def make(**overrides: object) -> ServerThread:
        server = ServerThread(replace(base_config, **overrides)).__enter__()
        started.append(server)
        return server

    yield make
    for server in started:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def demo_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from medserve.demo.study import write_demo_study

    out = tmp_path_factory.mktemp("demo") / "study"
    write_demo_study(out)
    return out


def small_study(out: Path, size: int = 24, slices: int = 12, seed: int = 0) -> Path:
    """A small CT series (a bright blob in soft tissue) that runs through the demo bundle in a fraction of the
    demo study's time; for the load and concurrency tests."""
    from medserve.demo.study import SeriesGeometry, write_ct_series

    rng = np.random.default_rng(seed)
    hu = rng.normal(40, 10, (slices, size, size))
    zz, yy, xx = np.mgrid[:slices, :size, :size]
    hu[(zz - slices / 2) ** 2 / 9 + (yy - size / 2) ** 2 / 16 + (xx - size / 2) ** 2 / 16 < 4] = 250
    write_ct_series(hu, out, SeriesGeometry(pixel_spacing=(4.0, 4.0), slice_spacing=4.0))
    return out


def multipart_files(folder: Path) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("files", (p.name, p.read_bytes(), "application/dicom")) for p in sorted(folder.iterdir())]


def with_thr(server: ServerThread, name: str = "thr") -> ServerThread:
    """Adds the fast thresholding bundle to the server's store as model `name` and waits until it is loaded."""
    add_bundle(server.config.store, name, make_threshold_bundle(Path(server.config.data_dir) / f"{name}_bundle"))
    server.store.wait_until(name, ("loaded",), 60)
    return server


@pytest.fixture
def thr_server(make_server) -> ServerThread:
    return with_thr(make_server())


class FakeDicomWeb:
    """A DICOMweb store on 127.0.0.1 that records what the server asks of it: every GET path, and the SOP Instance
    UIDs of each STOW-RS. WADO-RS answers with the files of `study`, each part labelled `part_type`; `trickle` sends
    it slowly, and `gone_away` tells when the server stopped reading it. `on_stow` runs before a STOW is answered,
    with `stow_answer` (status, DICOM JSON body, or text sent as DICOM XML). QIDO-RS for an instance lists the ones
    a STOW answered below 400 sent, unless `keeps_stowed` is false (a store whose filter drops them). A test may
    change the attributes."""

    def __init__(self, study: Path | None = None, on_stow: Callable[[], None] | None = None) -> None:
        self.paths: list[str] = []
        self.stowed: list[list[str]] = []
        self.kept: list[list[str]] = []  # what a STOW answered below 400 sent
        self.stow_framing: list[str] = []  # "chunked" or "length" per STOW request
        self.study = study
        self.part_type = "application/dicom"
        self.cut_get = False  # WADO-RS answers end halfway through, the connection closed
        self.trickle: float | None = None  # WADO-RS answers sent at this many bytes a second
        self.gone_away = threading.Event()  # set when the server stopped reading a trickled answer
        self.stow_answer: tuple[int, dict | str] = (200, {})
        self.keeps_stowed = True
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                fake.paths.append(self.path)
                path, _, query = self.path.partition("?")
                if path.endswith("/instances"):  # QIDO-RS
                    wanted = urllib.parse.parse_qs(query).get("SOPInstanceUID", [])
                    kept = [uid for uids in fake.kept for uid in uids if uid in wanted] if fake.keeps_stowed else []
                    self._answer(200, json.dumps([{"00080018": {"vr": "UI", "Value": [uid]}} for uid in kept]).encode(),
                                 "application/dicom+json")
                    return
                if fake.study is None:
                    self._answer(404, b"", "text/plain")
                    return
                boundary = "fakeboundary"
                body = b"".join(f"--{boundary}\r\nContent-Type: {fake.part_type}\r\n\r\n".encode() + p.read_bytes()
                                + b"\r\n" for p in sorted(fake.study.iterdir())) + f"--{boundary}--\r\n".encode()
                content_type = f'multipart/related; type="application/dicom"; boundary={boundary}'
                if fake.trickle is not None:
                    self.send_response(200)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    try:
                        for start in range(0, len(body), 100):
                            self.wfile.write(body[start:start + 100])
                            time.sleep(100 / fake.trickle)
                    except OSError:
                        fake.gone_away.set()
                    self.close_connection = True
                    return
                if fake.cut_get:
                    self.send_response(200)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[:len(body) // 2])
                    self.close_connection = True
                    return
                self._answer(200, body, content_type)

            def do_POST(self) -> None:  # noqa: N802
                boundary = self.headers["Content-Type"].split("boundary=")[1].strip('"').encode()
                parts = self._body().split(b"--" + boundary)[1:-1]
                fake.stowed.append([pydicom.dcmread(io.BytesIO(part.split(b"\r\n\r\n", 1)[1][:-2])).SOPInstanceUID
                                    for part in parts])
                if on_stow is not None:
                    on_stow()
                status, answer = fake.stow_answer
                if status < 400:
                    fake.kept.append(fake.stowed[-1])
                if isinstance(answer, str):
                    self._answer(status, answer.encode(), "application/dicom+xml")
                else:
                    self._answer(status, json.dumps(answer).encode(), "application/dicom+json")

            def _body(self) -> bytes:
                fake.stow_framing.append("chunked" if self.headers.get("Transfer-Encoding") == "chunked" else "length")
                if self.headers.get("Transfer-Encoding") != "chunked":
                    return self.rfile.read(int(self.headers["Content-Length"]))
                data = b""
                while size := int(self.rfile.readline().strip(), 16):
                    data += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return data

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/dicom-web"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeDicomWeb:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
