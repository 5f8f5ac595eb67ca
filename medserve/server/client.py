"""The CLI's HTTP client: resumable study upload (tus, via tuspy), job submission and polling, downloads."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from medserve.errors import DicomInputError, MedserveError
from medserve.server.states import FINAL_STATES

log = logging.getLogger("medserve.server.client")

CHUNK = 8 * 1024 * 1024
PARTIAL = ".partial"
UPLOADING = ".uploading"  # a link to a cached zip that a run is uploading from
UNREACHABLE_PATIENCE = 60.0  # seconds a request is tried again while the server cannot answer it (see `_Patience`)
# Answers that say "not now" (busy, a proxy before a restarting server, no room yet): the same request may pass later.
RETRY_STATUSES = frozenset({429, 502, 503, 504, 507})
# Of those, the ones that say the request was refused untouched (queue_full, database_busy, a proxy with no server
# behind it, insufficient_storage). A proxy's 502/504 may come after the server took the request, so a request
# that must not be made twice (a job submitted without an Idempotency-Key, a cancel) is not tried again on them.
REFUSED_UNTOUCHED = frozenset({429, 503, 507})
LONGEST_RETRY_WAIT = 15.0
ABANDONED_SECONDS = 24 * 3600


class ClientError(MedserveError):
    """The server refused or failed a request (the message is the server's own, `status` its HTTP status), or
    the request could not be made."""

    def __init__(self, message: str, status: int | None = None, retryable: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable  # the same request may pass later: see RETRY_STATUSES and `Client._unreachable`
        self.retry_after = retry_after


class _Patience:
    """Waits between tries of a request the server could not answer now: its Retry-After (at most
    LONGEST_RETRY_WAIT, at least 1 s), else 1, 2, 4, 8 s; for UNREACHABLE_PATIENCE seconds from the first
    failure, after which the failure stands. A server restarting (an upgrade, a crash) keeps its jobs and uploads,
    so a run waits for it rather than failing on the first refused connection or 503."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.since: float | None = None
        self.tries = 0

    def wait_or_raise(self, error: ClientError) -> None:
        if not error.retryable:
            raise error
        now = time.monotonic()
        self.since = self.since or now
        backoff = 2.0 ** min(self.tries, 3)
        delay = min(LONGEST_RETRY_WAIT, max(1.0, error.retry_after if error.retry_after is not None else backoff))
        if now + delay - self.since > UNREACHABLE_PATIENCE:
            raise error
        log.info("%s; trying again in %.0f s", error, delay)
        self.tries += 1
        time.sleep(delay)


def cache_dir() -> Path:
    """$MEDSERVE_CACHE (an empty one counts as unset, not as the current folder), else ~/.cache/medserve."""
    root = Path(os.environ.get("MEDSERVE_CACHE") or Path.home() / ".cache" / "medserve")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ClientError(f"cache folder {root} (MEDSERVE_CACHE): cannot be created ({error.strerror or error}); "
                          "expected a folder we can write to") from error
    return root


def study_zip(study_dir: Path) -> Path:
    """A deterministic zip of the study's DICOM files (sorted names, fixed timestamps, stored): the same folder
    always gives the same bytes, which is what lets a re-run resume the earlier upload instead of starting over.
    Other files (a CD's README.txt, autorun.inf, .DS_Store) are left out with a warning, as the DICOM loader
    skips them; the server would refuse them."""
    from medserve.dicom.index import files_under
    from medserve.server.inputs import NOT_DICOM, sniff

    try:  # the files the app would read: links to folders followed, an unreadable folder refused
        found = sorted(p for p in files_under(study_dir) if p.is_file())
    except DicomInputError as error:
        raise ClientError(str(error)) from error
    try:
        files = [p for p in found if sniff(p) == "dicom"]
    except OSError as error:
        raise ClientError(f"{error.filename}: cannot be read ({error.strerror})") from error
    others = [p.relative_to(study_dir).as_posix() for p in found if p not in files]
    if not files:
        what = f"{len(others)} files, none of them DICOM ({NOT_DICOM})" if others else "no files"
        raise ClientError(f"{study_dir}: nothing to upload: {what}")
    if others:
        log.warning("%s: leaving out %d files that are not DICOM: %s", study_dir, len(others),
                    ", ".join(others[:5]) + (", ..." if len(others) > 5 else ""))
    target = cache_dir() / "zips" / f"{_files_key(study_dir, files)}.zip"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(target.parent)
        # A name of its own: two runs of one study zip side by side, and either's finished zip is the same bytes.
        handle, name = tempfile.mkstemp(dir=target.parent, prefix=f"{target.stem}.", suffix=PARTIAL)
        os.close(handle)
    except OSError as error:
        raise ClientError(f"{target.parent}: cannot zip the study into the cache ({error.strerror or error}); "
                          "MEDSERVE_CACHE names another cache folder") from error
    partial = Path(name)
    try:
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for path in files:
                info = zipfile.ZipInfo(path.relative_to(study_dir).as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
                with open(path, "rb") as src, zf.open(info, "w", force_zip64=True) as out:
                    while block := src.read(1024 * 1024):
                        out.write(block)
        partial.replace(target)
    except OSError as error:  # the cache full or read-only; a study file that went away meanwhile
        raise ClientError(f"{error.filename or partial}: cannot zip the study into the cache "
                          f"({error.strerror or error}); MEDSERVE_CACHE names another cache folder") from error
    finally:
        partial.unlink(missing_ok=True)
    return target


def _files_key(study_dir: Path, files: list[Path]) -> str:
    """The cached zip's name: the study folder and, per file, its name, size, mtime, inode and ctime. Names,
    sizes and mtimes alone are not the content: studies unpacked from archives with fixed timestamps, copies
    made with `cp -p`, or an edit that keeps the mtime would find another study's zip. A file's ctime changes
    with any write and cannot be set back, and the folder and inodes tell copies apart."""
    key = hashlib.sha256(f"{study_dir.resolve()}\n".encode())
    for path in files:
        st = path.stat()
        key.update(f"{path.relative_to(study_dir).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0"
                   f"{st.st_ctime_ns}\n".encode())
    return key.hexdigest()[:32]


def _remove_abandoned(folder: Path) -> None:
    """What a killed run left: half-written zips (a day untouched: another run may be writing a recent one),
    and the links it uploaded through (a day after they were made, their ctime; their mtime is the zip's)."""
    now = time.time()
    for leftover in (*folder.glob(f"*{PARTIAL}"), *folder.glob(f"*{UPLOADING}")):
        with contextlib.suppress(OSError):
            st = leftover.stat()
            if now - (st.st_mtime if leftover.suffix == PARTIAL else st.st_ctime) > ABANDONED_SECONDS:
                leftover.unlink()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


class UploadKey:
    """tuspy's key for a stored upload URL (its `fingerprinter`): the server and the whole file's hash. tuspy's
    own key (the size and the first 64 KB) takes another study of the same size and start for the one uploaded
    before; and the same study sent to another server must not resume there."""

    def __init__(self, server_url: str, path: Path) -> None:
        self.key = f"{server_url.rstrip('/')} sha256:{_sha256(path)}"

    def get_fingerprint(self, fs: Any) -> str:
        return self.key


def _server_message(body: bytes | None) -> str:
    """An error answer's message: medserve's JSON `message` (or `error`), else one short line of the body (a
    proxy's HTML page, say)."""
    text = (body or b"").decode("utf-8", "replace")
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and (answer.get("message") or answer.get("error")):
        return str(answer.get("message") or answer.get("error"))
    return " ".join(text.split())[:200] or "(empty body)"


class UploadUrls:
    """tuspy's url storage: where each study's upload is, kept in the cache as one JSON object {key: url}.
    tuspy's own FileStorage (TinyDB) neither locks nor replaces its file atomically: parallel runs interleaved
    their writes, and every later run then failed reading it. Here each access holds an exclusive lock on a file
    beside it, a write replaces the file whole, and a file that cannot be read is started afresh (with a
    warning): the cost is one upload that starts from the beginning."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")

    @contextlib.contextmanager
    def _locked(self) -> Any:
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> dict[str, str]:
        try:
            urls = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            log.warning("%s cannot be read (%s); earlier uploads will start again", self.path, error)
            return {}
        if not isinstance(urls, dict) or not all(isinstance(v, str) for v in urls.values()):
            log.warning("%s is not a JSON object of upload URLs; earlier uploads will start again", self.path)
            return {}
        return urls

    def _write(self, urls: dict[str, str]) -> None:
        handle, name = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".", suffix=PARTIAL)
        try:
            with os.fdopen(handle, "w") as out:
                json.dump(urls, out, indent=1)
            os.replace(name, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    def get_item(self, key: str) -> str | None:
        with self._locked():
            return self._read().get(key)

    def set_item(self, key: str, value: str | None) -> None:
        if value is None:  # tuspy stores what it looked up, also when there was nothing
            self.remove_item(key)
            return
        with self._locked():
            self._write({**self._read(), key: value})

    def remove_item(self, key: str) -> None:
        with self._locked():
            urls = self._read()
            if urls.pop(key, None) is not None:
                self._write(urls)


class Client:
    def __init__(self, url: str, token: str | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        try:
            parsed = httpx.URL(self.url)
        except httpx.InvalidURL as error:
            raise ClientError(f"--url {url!r} is not a URL ({error}); expected http://HOST:PORT") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ClientError(f"--url {url!r}: expected http://HOST:PORT or https://HOST:PORT")
        if token is not None and (not token.isascii() or not token.isprintable()):
            raise ClientError("--token holds characters an HTTP header cannot carry; expected printable ASCII")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)
        self.answered = False  # whether the server has answered this client yet (see `_unreachable`)

    def _check(self, response: httpx.Response, repeatable: bool = True) -> httpx.Response:
        if response.status_code >= 400:
            from medserve.server.errors import header_int  # the server's modules stay out of the CLI's start

            retryable = response.status_code in (RETRY_STATUSES if repeatable else REFUSED_UNTOUCHED)
            # Retry-After in seconds; its HTTP-date form (medserve sends none) is read as absent
            raise ClientError(f"server answered {response.status_code}: {_server_message(response.content)}",
                              response.status_code, retryable, header_int(response.headers.get("retry-after")))
        return response

    def _unreachable(self, error: Exception, repeatable: bool = True) -> ClientError:
        """No answer. Once the server has answered this client (it is restarting, say), the request is tried
        again when it never reached the server (a refused connection) or when doing it twice does no harm
        (`repeatable`: a GET, a POST with an Idempotency-Key, a tus PATCH at its offset; not a cancel, whose second
        try would find the job cancelled, 409). A server that never answered is reported at once: a wrong --url
        should not cost a minute."""
        errno_text = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(error))  # urllib3's (tuspy's) text runs long
        reason = errno_text.group(1).strip() if errno_text else str(error) or type(error).__name__
        return ClientError(f"cannot reach the medserve server at {self.url}: {reason}",
                           retryable=self.answered and (repeatable or isinstance(error, httpx.ConnectError)))

    def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        """A request, tried again while the server cannot answer it now (see `_Patience`); its JSON answer, or a
        ClientError for an error status or a server that cannot be reached (which the CLI prints as one line, not
        as httpx's traceback)."""
        repeatable = method == "GET" or "Idempotency-Key" in kwargs.get("headers", {})
        patience = _Patience()
        while True:
            try:
                return self._send_once(method, path, repeatable, **kwargs)
            except ClientError as error:
                patience.wait_or_raise(error)

    def _send_once(self, method: str, path: str, repeatable: bool, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as error:
            raise self._unreachable(error, repeatable) from error
        self.answered = True
        self._check(response, repeatable)
        try:
            return response.json()
        except ValueError:  # a redirect, or a server that is not medserve
            raise ClientError(f"{method} {response.url} answered {response.status_code} with no JSON "
                              f"({response.headers.get('content-type') or 'no content type'}); is {self.url} a "
                              "medserve server?", response.status_code) from None

    def get(self, path: str, **params: Any) -> Any:
        return self._send("GET", path, params=params)

    def delete(self, path: str) -> Any:
        return self._send("DELETE", path)

    def upload(self, path: Path, progress: Callable[[int, int], None] | None = None) -> str:
        """tus upload of `path`, resuming an earlier partial upload of the same bytes to this server; returns the
        upload id. An upload the server no longer has (expired or deleted) is forgotten and started again.

        The bytes are read through a link of their own: another run of the same study that finishes meanwhile
        removes the cached zip, and tuspy opens the file again for every chunk."""
        private = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}{UPLOADING}")
        try:
            os.link(path, private)
        except FileNotFoundError as error:
            raise ClientError(f"{path}: the study's zip was removed meanwhile (a run of the same study finished); "
                              "run again") from error
        except OSError:  # a file system without hard links: read the zip itself
            return self._upload(path, path.name, progress)
        try:
            return self._upload(private, path.name, progress)
        finally:
            private.unlink(missing_ok=True)

    def _upload(self, path: Path, name: str, progress: Callable[[int, int], None] | None) -> str:
        from tusclient import client as tus
        from tusclient.exceptions import TusCommunicationError, TusUploadFailed

        storage = UploadUrls(cache_dir() / "tus-uploads.json")
        tus_client = tus.TusClient(f"{self.url}/v1/uploads", headers=dict(self.headers))
        fingerprint = UploadKey(self.url, path)
        patience = _Patience()
        restarted = False
        while True:
            try:
                # With a stored URL, the constructor already asks the server for the offset.
                uploader = tus_client.uploader(str(path), chunk_size=CHUNK, store_url=True, url_storage=storage,
                                               fingerprinter=fingerprint, metadata={"filename": name},
                                               upload_checksum=True, retries=3, retry_delay=1)
                size = uploader.get_file_size()
                while uploader.offset < size:
                    uploader.upload_chunk()
                    self.answered = True
                    patience.reset()  # a later restart gets the whole patience again
                    if progress is not None:
                        progress(uploader.offset, size)
                return uploader.url.rstrip("/").rsplit("/", 1)[-1]
            except (TusCommunicationError, TusUploadFailed) as error:
                if error.status_code in (404, 410) and not restarted:  # expired or deleted: start it afresh, once
                    storage.remove_item(fingerprint.key)
                    restarted = True
                    continue
                # A server restarting or out of room for now: resumed from the offset it kept, once it answers.
                patience.wait_or_raise(self._upload_error(error))

    def _upload_error(self, error: Any) -> ClientError:
        """tuspy's error as ours. tuspy wraps a connection error (no answer at all) with no status, and keeps no
        Retry-After of an answer."""
        if error.status_code is None:
            return self._unreachable(error)
        return ClientError(f"upload failed: server answered {error.status_code}: "
                           f"{_server_message(error.response_content)}", error.status_code,
                           error.status_code in RETRY_STATUSES)

    def check_model(self, name: str) -> None:
        """A ClientError when the server has no model `name` (or refuses the name). A token without the admin
        scope may not look models up: the job request then finds out."""
        from medserve.server.store import NAME_RULE, is_model_name

        if not is_model_name(name):  # '..' would not even reach the server: the URL's path would lose it
            raise ClientError(f"invalid model name {name[:100]!r}: {NAME_RULE}")
        try:
            self.get(f"/v1/models/{quote(name, safe='')}")
        except ClientError as error:
            if error.status != 403:
                raise

    def submit(self, model: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
        headers = {"Idempotency-Key": key} if key else {}
        return self._send("POST", "/v1/jobs", params={"model": model}, json=body, headers=headers)

    def wait(self, job_id: str, on_update: Callable[[dict[str, Any]], None] | None = None,
             timeout: float = 24 * 3600, interval: float = 0.25) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        self.answered = True  # the server took the job: one that cannot be reached now is restarting
        while True:
            job = self.get(f"/v1/jobs/{quote(job_id, safe='')}")  # waits out a restarting server (`_send`)
            if on_update is not None:
                on_update(job)
            if job["state"] in FINAL_STATES:
                return job
            if time.monotonic() > deadline:
                raise ClientError(f"job {job_id} still {job['state']} after {timeout} s")
            time.sleep(interval)

    def download(self, job_id: str, target: Path, fmt: str | None = None) -> Path:
        """The job's result into `target`; a download cut or refused for now is made again (see `_Patience`)."""
        target.parent.mkdir(parents=True, exist_ok=True)
        patience = _Patience()
        while True:
            try:
                return self._download_once(job_id, target, fmt)
            except ClientError as error:
                patience.wait_or_raise(error)

    def _download_once(self, job_id: str, target: Path, fmt: str | None) -> Path:
        params = {"format": fmt} if fmt else {}
        partial = target.with_suffix(target.suffix + ".partial")
        try:
            with self.http.stream("GET", f"/v1/jobs/{quote(job_id, safe='')}/result", params=params) as response:
                self.answered = True
                if response.status_code >= 400:
                    response.read()
                    self._check(response)
                with open(partial, "wb") as out:
                    for block in response.iter_bytes(1024 * 1024):
                        out.write(block)
            partial.replace(target)
        except httpx.TransportError as error:
            raise self._unreachable(error) from error
        except OSError as error:  # a full disk, a folder in the result's place
            raise ClientError(f"{target}: cannot be written ({error.strerror or error})") from error
        finally:  # whatever stopped it (Ctrl-C too), a partial download is not left beside the results
            partial.unlink(missing_ok=True)
        return target
