"""The CLI's HTTP client: resumable study upload (tus, via tuspy), job submission and polling, downloads."""

from __future__ import annotations

import hashlib
import logging
import os
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from medserve.errors import MedserveError

log = logging.getLogger("medserve.server.client")

CHUNK = 8 * 1024 * 1024
FINAL = ("succeeded", "failed", "cancelled")


class ClientError(MedserveError):
    """The server refused or failed a request; the message is the server's own."""


def cache_dir() -> Path:
    root = Path(os.environ.get("MEDSERVE_CACHE", Path.home() / ".cache" / "medserve"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def study_zip(study_dir: Path) -> Path:
    """A deterministic zip of the study (sorted names, fixed timestamps, stored): the same folder always gives
    the same bytes, which is what lets a re-run resume the earlier upload instead of starting over."""
    files = sorted(p for p in study_dir.rglob("*") if p.is_file())
    if not files:
        raise ClientError(f"{study_dir}: no files to upload")
    key = hashlib.sha256()
    for path in files:
        st = path.stat()
        key.update(f"{path.relative_to(study_dir).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    target = cache_dir() / "zips" / f"{key.hexdigest()[:32]}.zip"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for path in files:
            info = zipfile.ZipInfo(path.relative_to(study_dir).as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
            with open(path, "rb") as src, zf.open(info, "w", force_zip64=True) as out:
                while block := src.read(1024 * 1024):
                    out.write(block)
    partial.replace(target)
    return target


class Client:
    def __init__(self, url: str, token: str | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            try:
                body = response.json()
                message = body.get("message") or body.get("error") or response.text
            except ValueError:
                message = response.text[:300]
            raise ClientError(f"server answered {response.status_code}: {message}")
        return response

    def get(self, path: str, **params: Any) -> Any:
        try:
            return self._check(self.http.get(path, params=params)).json()
        except httpx.ConnectError as error:
            raise ClientError(f"cannot reach the server at {self.url}: {error}") from error

    def upload(self, path: Path, progress: Callable[[int, int], None] | None = None) -> str:
        """tus upload of `path`, resuming an earlier partial upload of the same file; returns the upload id."""
        from tusclient import client as tus
        from tusclient.exceptions import TusCommunicationError, TusUploadFailed
        from tusclient.storage.filestorage import FileStorage

        storage = FileStorage(str(cache_dir() / "tus-urls.json"))
        tus_client = tus.TusClient(f"{self.url}/v1/uploads", headers=dict(self.headers))
        for attempt in range(2):
            uploader = tus_client.uploader(str(path), chunk_size=CHUNK, store_url=True, url_storage=storage,
                                           metadata={"filename": path.name}, upload_checksum=True, retries=3,
                                           retry_delay=1)
            try:
                size = uploader.get_file_size()
                while uploader.offset < size:
                    uploader.upload_chunk()
                    if progress is not None:
                        progress(uploader.offset, size)
                return uploader.url.rstrip("/").rsplit("/", 1)[-1]
            except (TusCommunicationError, TusUploadFailed) as error:
                # The stored upload expired or was deleted on the server: forget it and start once more.
                if attempt == 0 and getattr(error, "status_code", None) in (404, 410):
                    storage.remove_item(uploader._get_fingerprint())
                    continue
                raise ClientError(f"upload failed: {error} {getattr(error, 'response_content', '')!r}") from error
        raise ClientError("upload failed twice")

    def submit(self, model: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
        headers = {"Idempotency-Key": key} if key else {}
        return self._check(self.http.post("/v1/jobs", params={"model": model}, json=body, headers=headers)).json()

    def wait(self, job_id: str, on_update: Callable[[dict[str, Any]], None] | None = None,
             timeout: float = 24 * 3600, interval: float = 0.25) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(f"/v1/jobs/{job_id}")
            if on_update is not None:
                on_update(job)
            if job["state"] in FINAL:
                return job
            if time.monotonic() > deadline:
                raise ClientError(f"job {job_id} still {job['state']} after {timeout} s")
            time.sleep(interval)

    def download(self, job_id: str, target: Path, fmt: str | None = None) -> Path:
        target.parent.mkdir(parents=True, exist_ok=True)
        params = {"format": fmt} if fmt else {}
        with self.http.stream("GET", f"/v1/jobs/{job_id}/result", params=params) as response:
            if response.status_code >= 400:
                response.read()
                self._check(response)
            partial = target.with_suffix(target.suffix + ".partial")
            with open(partial, "wb") as out:
                for block in response.iter_bytes(1024 * 1024):
                    out.write(block)
            partial.replace(target)
        return target
