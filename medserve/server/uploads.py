"""tus 1.0.0 resumable uploads at /v1/uploads: core protocol plus creation, termination, expiration and checksum.

Each upload is two files under `<data-dir>/uploads/`: `ID.bin` (the bytes received so far, whose size *is* the
offset, so a crash loses nothing that was written) and `ID.json` (declared length, metadata, expiry). Bodies are
streamed to disk in 1 MiB-4 MiB writes off the event loop; nothing is held in memory. A PATCH that would go past
the declared length is refused with 413 and its bytes are dropped; a PATCH whose Upload-Checksum does not match
is dropped with 460. While a checksummed PATCH writes, `ID.pending` holds the offset it started at: a server that
crashed in the middle of it truncates the upload back to there when it starts again, so that a resuming client
never builds on bytes that were not verified.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, Depends, Request
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from medserve.server.auth import require
from medserve.server.errors import ApiError, disk_full, header_int, insufficient_storage, shown
from medserve.server.services import services
from medserve.server.streams import Interrupt, body_chunks

log = logging.getLogger("medserve.server.uploads")

TUS_VERSION = "1.0.0"
EXTENSIONS = "creation,termination,expiration,checksum"
CHECKSUMS = {"sha1": hashlib.sha1, "md5": hashlib.md5, "sha256": hashlib.sha256}
ID_RE = re.compile(r"[0-9a-f]{32}")
WRITE_BATCH = 4 * 1024 * 1024
TAKEOVER_SECONDS = 10.0  # how long a request waits for the PATCH it asked to end (it ends at its next chunk)
TAKEOVER_POLL_SECONDS = 0.5
TAKEN_OVER, SERVER_STOPPING = "taken over", "server stopping"  # why a PATCH's body was ended (Interrupt.reason)
RETRY_AFTER_STOP_SECONDS = 5


@dataclass
class UploadInfo:
    id: str
    length: int
    metadata: dict[str, str] = field(default_factory=dict)  # decoded (a value that is not UTF-8: its base64)
    created: float = 0.0
    expires: float = 0.0
    metadata_header: str = ""  # Upload-Metadata as the client sent it (pairs re-joined), echoed by HEAD


def _http_date(ts: float) -> str:
    return time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(ts))


def parse_metadata(header: str) -> tuple[dict[str, str], str]:
    """`key base64value,key2 base64value2,key3` -> (decoded values, the header re-joined for HEAD). A value
    that is not UTF-8 is kept as its base64; a key may come without a value (tus 1.0.0)."""
    out: dict[str, str] = {}
    pairs: list[str] = []
    for item in filter(None, (part.strip() for part in header.split(","))):
        key, _, value = item.partition(" ")
        value = value.strip()
        if not key.isascii() or not key.isprintable():
            raise ApiError(400, "bad_metadata", f"Upload-Metadata key {key[:100]!r}: keys are printable ASCII "
                           "without spaces or commas")
        if key in out:  # tus 1.0.0: "All keys MUST be unique"
            raise ApiError(400, "bad_metadata", f"Upload-Metadata names the key {key!r} twice")
        try:
            raw = base64.b64decode(value, validate=True) if value else b""
        except binascii.Error as error:
            raise ApiError(400, "bad_metadata", f"Upload-Metadata value for {key!r} is not base64") from error
        try:
            out[key] = raw.decode()
        except UnicodeDecodeError:
            out[key] = value
        pairs.append(f"{key} {value}" if value else key)
    return out, ",".join(pairs)


class UploadStore:
    """Upload files on disk and the operations the tus routes and the inference inputs need."""

    def __init__(self, root: Path, max_bytes: int, expiry_seconds: float, idle_seconds: float = 60.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.expiry_seconds = expiry_seconds
        self.idle_seconds = idle_seconds
        self._locks: dict[str, asyncio.Lock] = {}
        self._writers: dict[str, Interrupt] = {}  # the PATCH writing an upload, for a later request to end
        self._stopping = False
        for marker in self.root.glob("*.pending"):
            _drop_unverified(marker)

    def _paths(self, upload_id: str) -> tuple[Path, Path]:
        if not ID_RE.fullmatch(upload_id):
            raise ApiError(404, "unknown_upload", f"no upload {shown(upload_id)}")
        return self.root / f"{upload_id}.bin", self.root / f"{upload_id}.json"

    def create(self, length: int, metadata_header: str = "") -> UploadInfo:
        """A new, empty upload; `metadata_header` is the client's Upload-Metadata (400 bad_metadata if broken)."""
        metadata, normalized = parse_metadata(metadata_header)
        now = time.time()
        info = UploadInfo(uuid.uuid4().hex, length, metadata, now, now + self.expiry_seconds, normalized)
        data = self._paths(info.id)[0]
        # The description first: every upload's bytes then have one that `sweep` finds, even after a crash here.
        try:
            self._write_info(info)
            data.open("xb").close()
        except BaseException:
            self.delete(info.id)
            raise
        return info

    def _write_info(self, info: UploadInfo) -> None:
        meta = self._paths(info.id)[1]
        tmp = meta.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(asdict(info)))
            tmp.replace(meta)
        finally:
            tmp.unlink(missing_ok=True)

    def info(self, upload_id: str) -> UploadInfo:
        data, meta = self._paths(upload_id)
        try:
            info = UploadInfo(**json.loads(meta.read_text()))
        except FileNotFoundError as error:
            raise ApiError(404, "unknown_upload", f"no upload {shown(upload_id)}") from error
        if info.expires < time.time() and not self.busy(upload_id):  # a PATCH in progress renews it at its end
            self.delete(upload_id)
            raise ApiError(410, "upload_expired", f"upload {upload_id!r} expired")
        return info

    def offset(self, upload_id: str) -> int:
        try:
            return self._paths(upload_id)[0].stat().st_size
        except FileNotFoundError as error:
            raise ApiError(404, "unknown_upload", f"no upload {shown(upload_id)}") from error

    def touch(self, info: UploadInfo) -> None:
        """Activity extends the expiry (an upload that is being resumed should not vanish); refused (404) when its
        bytes were removed meanwhile, rather than bringing back the description of an upload without data."""
        if not self._paths(info.id)[0].exists():
            raise ApiError(404, "unknown_upload", f"upload {info.id!r} was removed while it was being written")
        info.expires = time.time() + self.expiry_seconds
        self._write_info(info)

    def pending_path(self, upload_id: str) -> Path:
        """Where a checksummed PATCH records the offset it started at until its bytes are verified."""
        return self._paths(upload_id)[0].with_suffix(".pending")

    def delete(self, upload_id: str) -> None:
        for path in (*self._paths(upload_id), self.pending_path(upload_id)):
            path.unlink(missing_ok=True)
        if not self.busy(upload_id):
            self._locks.pop(upload_id, None)

    def finished(self, upload_id: str) -> Path:
        """The file of a complete upload, for `{"upload": id}` inputs."""
        info = self.info(upload_id)
        if self.busy(upload_id):  # its last bytes may still be rolled back (a checksum that does not match)
            raise ApiError(409, "upload_in_progress", f"upload {upload_id!r} is being written by a PATCH; use it "
                           f"once that has ended")
        offset = self.offset(upload_id)
        if offset != info.length:
            raise ApiError(409, "upload_incomplete",
                           f"upload {upload_id!r} has {offset} of {info.length} bytes; finish it first")
        return self._paths(upload_id)[0]

    def sweep(self) -> int:
        """Delete expired uploads; returns how many went. Files a crash left without a description (bytes of an
        upload being created, a description being rewritten) go once they are older than the expiry."""
        gone = 0
        now = time.time()
        for meta in self.root.glob("*.json"):
            try:
                if json.loads(meta.read_text())["expires"] < now and not self.busy(meta.stem):
                    self.delete(meta.stem)
                    gone += 1
            except (OSError, ValueError, KeyError, ApiError):
                continue
        for leftover in [*self.root.glob("*.json.tmp"), *self.root.glob("*.bin")]:
            orphan = leftover.suffix == ".tmp" or not leftover.with_suffix(".json").exists()
            try:
                if orphan and leftover.stat().st_mtime < now - self.expiry_seconds:
                    leftover.unlink()
            except FileNotFoundError:
                continue
        return gone

    @contextlib.asynccontextmanager
    async def writing(self, upload_id: str) -> AsyncIterator[Interrupt]:
        """Hold the upload for one PATCH (or DELETE). A request that finds it held asks the holder to end (its
        body stops being read, as a cut would stop it) and waits up to TAKEOVER_SECONDS for it: tusd's answer to
        a client that resumes while its old connection, dropped without a word, still holds the upload. 423
        when the holder does not let go in that time."""
        lock = self._locks.setdefault(upload_id, asyncio.Lock())
        loop = asyncio.get_running_loop()
        given_up = loop.time() + TAKEOVER_SECONDS
        while True:  # the holder may change while this waits (another request took it over first): ask each one
            if upload_id in self._writers:
                self._writers[upload_id].request(TAKEN_OVER)
            try:
                async with asyncio.timeout(min(TAKEOVER_POLL_SECONDS, max(0.0, given_up - loop.time()))):
                    await lock.acquire()
                break
            except TimeoutError:
                if loop.time() >= given_up:
                    raise ApiError(423, "upload_locked", f"another request is writing this upload and did not stop "
                                   f"within {TAKEOVER_SECONDS:g} s") from None
        interrupt = self._writers[upload_id] = Interrupt()
        if self._stopping:  # a resume that waited for the lock while the server began to stop
            interrupt.request(SERVER_STOPPING)
        try:
            yield interrupt
        finally:
            if self._writers.get(upload_id) is interrupt:
                del self._writers[upload_id]
            lock.release()
            if not lock.locked() and not self._paths(upload_id)[1].exists():  # deleted: forget its lock
                self._locks.pop(upload_id, None)

    def stop_writers(self) -> None:
        """The server is stopping: every PATCH in progress, or that takes an upload from now on, stops reading its
        body and answers at once (503, with the offset it kept), rather than being cut off when the grace period
        ends."""
        self._stopping = True
        for interrupt in list(self._writers.values()):
            interrupt.request(SERVER_STOPPING)

    def busy(self, upload_id: str) -> bool:
        """A PATCH is writing the upload (expiry waits for it to end)."""
        lock = self._locks.get(upload_id)
        return lock is not None and lock.locked()


def _tus_headers(**extra: str) -> dict[str, str]:
    return {"Tus-Resumable": TUS_VERSION, "Cache-Control": "no-store", **extra}


def _check_version(request: Request) -> None:
    if request.headers.get("tus-resumable") != TUS_VERSION:
        raise ApiError(412, "tus_version", f"Tus-Resumable: {TUS_VERSION} is required",
                       {"Tus-Version": TUS_VERSION})


def _uploads(request: Request) -> UploadStore:
    return services(request).uploads


PREFIX = "/v1/uploads"
router = APIRouter(prefix=PREFIX, tags=["uploads (tus 1.0.0)"])


class TusProtocol:
    """ASGI middleware for the tus paths. Every response carries Tus-Resumable (tus 1.0.0 asks for it on all but
    OPTIONS's), including those no tus route made: routing's 404/405 and trailing-slash redirect, auth refusals,
    errors (but a 500, which Starlette's outermost middleware answers); every HEAD answer, Cache-Control:
    no-store. And X-HTTP-Method-Override (for clients behind proxies that only pass GET and POST) is taken as the
    request's method, which the protocol says it MUST be, the actual method being ignored."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        override = Headers(scope=scope).get("x-http-method-override")
        if override:
            scope = {**scope, "method": override.strip().upper()}
        if scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return

        async def send_with_version(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if "tus-resumable" not in headers:
                    headers.append("Tus-Resumable", TUS_VERSION)
                if scope["method"] == "HEAD" and "cache-control" not in headers:  # its 404/410 too (the spec's MUST)
                    headers.append("Cache-Control", "no-store")
            await send(message)

        await self.app(scope, receive, send_with_version)


@router.options("")
@router.options("/{upload_id}")
async def options(request: Request) -> Response:
    store = _uploads(request)
    return Response(status_code=204, headers=_tus_headers(**{
        "Tus-Version": TUS_VERSION, "Tus-Extension": EXTENSIONS, "Tus-Max-Size": str(store.max_bytes),
        "Tus-Checksum-Algorithm": ",".join(CHECKSUMS)}))


@router.post("", dependencies=[Depends(require("infer"))], status_code=201)
async def create(request: Request) -> Response:
    _check_version(request)
    store = _uploads(request)
    if request.headers.get("upload-defer-length"):
        raise ApiError(400, "defer_length_unsupported", "Upload-Defer-Length is not supported; send Upload-Length")
    length = header_int(request.headers.get("upload-length"))
    if length is None:
        raise ApiError(400, "bad_upload_length", "Upload-Length must be a non-negative integer")
    if length > store.max_bytes:
        raise ApiError(413, "upload_too_large", f"Upload-Length {length} exceeds the limit of {store.max_bytes}",
                       {"Tus-Max-Size": str(store.max_bytes)})
    info = store.create(length, request.headers.get("upload-metadata", ""))
    log.info("upload %s created (%d bytes, %s)", info.id, length, info.metadata.get("filename"))
    location = str(request.url_for("upload_head", upload_id=info.id))
    return Response(status_code=201, headers=_tus_headers(
        Location=location, **{"Upload-Expires": _http_date(info.expires), "Upload-Offset": "0"}))


@router.head("/{upload_id}", name="upload_head", dependencies=[Depends(require("infer"))])
async def head(request: Request, upload_id: str) -> Response:
    _check_version(request)
    store = _uploads(request)
    info = store.info(upload_id)
    headers = _tus_headers(**{"Upload-Offset": str(store.offset(upload_id)), "Upload-Length": str(info.length),
                              "Upload-Expires": _http_date(info.expires)})
    if info.metadata_header:
        headers["Upload-Metadata"] = info.metadata_header
    return Response(status_code=200, headers=headers)


@router.get("/{upload_id}", dependencies=[Depends(require("infer"))])
async def describe(request: Request, upload_id: str) -> JSONResponse:
    """Not part of tus: a JSON view of one upload, handy with curl."""
    store = _uploads(request)
    info = store.info(upload_id)
    offset = store.offset(upload_id)
    return JSONResponse({"id": info.id, "length": info.length, "offset": offset, "complete": offset == info.length,
                         "metadata": info.metadata, "expires": _http_date(info.expires)})


@router.patch("/{upload_id}", dependencies=[Depends(require("infer"))])
async def patch(request: Request, upload_id: str) -> Response:
    _check_version(request)
    store = _uploads(request)
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/offset+octet-stream":
        raise ApiError(415, "bad_content_type", "PATCH needs Content-Type: application/offset+octet-stream")
    checksum = None
    if "upload-checksum" in request.headers:
        algo, _, digest = request.headers["upload-checksum"].partition(" ")
        if algo not in CHECKSUMS:
            raise ApiError(400, "bad_checksum_algorithm", f"Upload-Checksum algorithm {algo!r} is not one of "
                           f"{','.join(CHECKSUMS)}")
        try:
            checksum = (CHECKSUMS[algo](), base64.b64decode(digest.strip(), validate=True))
        except binascii.Error as error:
            raise ApiError(400, "bad_checksum", "Upload-Checksum digest is not base64") from error
        if len(checksum[1]) != checksum[0].digest_size:  # no digest at all would be a 460 after the whole body
            raise ApiError(400, "bad_checksum", f"Upload-Checksum needs 'ALGORITHM BASE64-DIGEST' with the "
                           f"{checksum[0].digest_size}-byte {algo} digest; got {len(checksum[1])} byte(s)")
    store.info(upload_id)  # 404/410 first, so that only uploads that exist get a lock
    claimed = request.headers.get("upload-offset")
    claimed_offset = header_int(claimed)
    if claimed_offset is None:  # before taking the upload over: a malformed request must not end a good one
        raise ApiError(400, "bad_upload_offset", f"Upload-Offset must be a non-negative integer, not {claimed!r}",
                       {"Upload-Offset": str(store.offset(upload_id))})
    async with store.writing(upload_id) as interrupt:
        info = store.info(upload_id)  # again: a DELETE may have taken it over meanwhile
        data_path = store._paths(upload_id)[0]
        offset = store.offset(upload_id)
        if claimed_offset != offset:
            raise ApiError(409, "offset_mismatch", f"Upload-Offset {claimed} != current offset {offset}",
                           {"Upload-Offset": str(offset)})
        body = Body(request, offset, info.length, store.idle_seconds, interrupt)
        try:
            if checksum is None:
                received = await _receive(body, data_path)
            else:
                received = await _receive_verified(body, data_path, store.pending_path(upload_id), checksum)
        except OSError as error:
            if not disk_full(error):
                raise
            log.error("no room left on the server's disk for upload %s: %s", upload_id, error)
            raise insufficient_storage("this upload chunk",  # what was written is kept, as for a cut PATCH
                                       {"Upload-Offset": str(store.offset(upload_id))}) from error
        store.touch(info)
        new_offset = offset + received
        if new_offset == info.length:
            log.info("upload %s complete (%d bytes)", upload_id, info.length)
        headers = {"Upload-Offset": str(new_offset), "Upload-Expires": _http_date(info.expires)}
        kept = "the bytes received were kept" if checksum is None else "the checksummed chunk was dropped"
        if body.ended == "stalled":
            raise ApiError(408, "upload_stalled", f"no body bytes for {store.idle_seconds:g} s; {kept}; resume "
                           f"from Upload-Offset {new_offset}", {**headers, "Connection": "close"})
        if body.ended == TAKEN_OVER:
            raise ApiError(409, "upload_interrupted", f"another request took this upload over; {kept}; resume "
                           f"from Upload-Offset {new_offset}", {**headers, "Connection": "close"})
        if body.ended == SERVER_STOPPING:
            raise ApiError(503, "server_stopping", f"the server is stopping; {kept}; resume from Upload-Offset "
                           f"{new_offset} once it is back", {**headers, "Connection": "close",
                                                             "Retry-After": str(RETRY_AFTER_STOP_SECONDS)})
        return Response(status_code=204, headers=_tus_headers(**headers))


class Body:
    """A PATCH's body as it arrives, to be written at the upload's `offset` without going past its declared
    `length`. `ended` says how it ended: "complete", "disconnected" (the client went away), "stalled" (no bytes
    for `idle_seconds`, see `medserve.server.streams`), "taken over" (another request asked it to end, see
    `UploadStore.writing`) or "server stopping" (`UploadStore.stop_writers`)."""

    def __init__(self, request: Request, offset: int, length: int, idle_seconds: float,
                 interrupt: Interrupt | None = None) -> None:
        self.request = request
        self.offset = offset
        self.length = length
        self.idle_seconds = idle_seconds
        self.interrupt = interrupt
        self.ended = "complete"

    async def chunks(self) -> Any:
        try:
            async with contextlib.aclosing(body_chunks(self.request, self.idle_seconds, self.interrupt)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except ClientDisconnect:
            self.ended = "disconnected"
        except TimeoutError:
            self.ended = (self.interrupt.reason if self.interrupt is not None else "") or "stalled"


async def _receive(body: Body, path: Path) -> int:
    """Stream the body onto the upload at its offset; returns the bytes kept: what arrived, also from a client
    that went away or stalled (that is what resuming is for)."""
    with open(path, "r+b") as out:
        out.seek(body.offset)
        received = await _write_body(body, out, None)
    if body.ended != "complete":
        log.info("upload %s: client %s after %d bytes; kept for resuming", path.stem, body.ended, received)
    return received


async def _receive_verified(body: Body, path: Path, pending: Path, checksum: tuple[Any, bytes]) -> int:
    """Stream a checksummed body onto the upload at its offset and keep it if its digest matches; returns the
    bytes kept (none when the client went away or stalled before the end: the digest is of the whole body).
    `pending` marks the bytes as unverified meanwhile, for a start after a crash (`_drop_unverified`)."""
    digest, expected = checksum
    offset = body.offset
    pending.write_text(str(offset))  # before any byte is written: a marker that holds no offset marks none
    try:
        with open(path, "r+b") as out:
            out.seek(offset)
            try:
                received = await _write_body(body, out, digest)
                if body.ended == "complete" and digest.digest() != expected:
                    raise ApiError(460, "checksum_mismatch", "Upload-Checksum does not match the body; chunk "
                                   "dropped", {"Upload-Offset": str(offset)})
            except BaseException:
                with anyio.CancelScope(shield=True):  # a stopping server cancels the request: drop the chunk still
                    await anyio.to_thread.run_sync(_truncate, out, offset)
                raise
            if body.ended != "complete":
                await anyio.to_thread.run_sync(_truncate, out, offset)
                return 0
        return received
    finally:
        pending.unlink(missing_ok=True)


def _drop_unverified(marker: Path) -> None:
    """Truncate an upload back to where the checksummed PATCH that a crash cut started (`marker` holds it)."""
    try:
        offset = int(marker.read_text())
    except ValueError:
        offset = None  # the crash came while the marker was written: no byte of that PATCH was
    data = marker.with_suffix(".bin")
    if offset is not None and data.exists() and data.stat().st_size > offset:
        os.truncate(data, offset)
        log.info("upload %s: dropped the unverified bytes of a checksummed PATCH a crash cut", marker.stem)
    marker.unlink(missing_ok=True)


async def _write_body(body: Body, out: Any, digest: Any | None) -> int:
    """Write the body to `out` from where it stands; returns the bytes received (`body.ended` says how it
    ended). A body that goes past the upload's declared length is dropped from `out` with 413."""
    start = out.tell()
    received = 0
    buffer = bytearray()
    async with contextlib.aclosing(body.chunks()) as chunks:  # closed here also when a 413 ends it early
        async for chunk in chunks:
            received += len(chunk)
            if body.offset + received > body.length:
                await anyio.to_thread.run_sync(_truncate, out, start)
                raise ApiError(413, "upload_too_long", f"body goes past the declared Upload-Length {body.length}",
                               {"Upload-Offset": str(body.offset)})
            if digest is not None:
                digest.update(chunk)
            buffer += chunk
            if len(buffer) >= WRITE_BATCH:
                await anyio.to_thread.run_sync(out.write, bytes(buffer))
                buffer.clear()
    if buffer:
        await anyio.to_thread.run_sync(out.write, bytes(buffer))
    await anyio.to_thread.run_sync(out.flush)
    return received


def _truncate(handle: Any, offset: int) -> None:
    handle.flush()
    handle.truncate(offset)
    os.fsync(handle.fileno())


@router.delete("/{upload_id}", dependencies=[Depends(require("infer"))], status_code=204)
async def terminate(request: Request, upload_id: str) -> Response:
    """Termination extension: the upload and its bytes are gone; later requests get 404."""
    _check_version(request)
    store = _uploads(request)
    store.info(upload_id)
    async with store.writing(upload_id):  # a PATCH writing it is asked to end first
        store.info(upload_id)
        store.delete(upload_id)
    return Response(status_code=204, headers=_tus_headers())
