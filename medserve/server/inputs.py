"""Turning a request body into a study on disk: DICOM files, a zip of them, a NIfTI file, a finished tus upload
or a DICOMweb reference. Every input is streamed to a folder of its own; nothing is parsed in memory."""

from __future__ import annotations

import contextlib
import errno
import gzip
import logging
import lzma
import os
import re
import shutil
import stat
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import anyio
from python_multipart.multipart import parse_options_header
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message

from medserve.dicom.index import looks_like_dicom
from medserve.net import without_credentials
from medserve.server.errors import ApiError, disk_full, header_int, insufficient_storage, shown
from medserve.server.multipart import FilePart, MultipartReader, body_charset
from medserve.server.services import services
from medserve.server.streams import body_chunks, stalled

log = logging.getLogger("medserve.server.inputs")

OPTION_FIELDS = ("format", "writeback", "model")  # in the query string, or fields beside the input
JSON_INPUT_FIELDS = ("upload", "study", "series", "store")
MAX_JSON_BYTES = 1024 * 1024  # {"upload": ID} / {"study", "series"} references are a few hundred bytes
MAX_FORM_FILES = 100_000  # files in one multipart body: many CT series have over 1,000 slices
UID_RE = re.compile(r"[0-9]+(\.[0-9]+)*")  # DICOM UIDs: digits and dots, at most 64 characters (PS3.5 9.1)


@dataclass
class InputSpec:
    """What to run on: `kind` is "dicom" (a folder), "nifti" (a file) or "dicomweb" (pulled later)."""

    kind: str
    path: Path | None = None
    study: str | None = None
    series: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path) if self.path else None, "study": self.study,
                "series": self.series}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InputSpec:
        path = data.get("path")
        return cls(data["kind"], Path(path) if path else None, data.get("study"), data.get("series"))


# Why sniff() does not call a file DICOM, for messages.
NOT_DICOM = "neither the 'DICM' marker at byte 128 nor a dataset at byte 0"


def sniff(path: Path) -> str:
    """"zip", "nifti", "dicom" or "unknown", from the first bytes (never from the name alone)."""
    with open(path, "rb") as handle:
        head = handle.read(352)
    if head[:4] == b"PK\x03\x04" or head[:4] == b"PK\x05\x06":
        return "zip"
    if _is_nifti(head):
        return "nifti"
    if looks_like_dicom(head):  # as the core's index reads it, files without the preamble too
        return "dicom"
    if head[:2] == b"\x1f\x8b":
        try:
            with gzip.open(path, "rb") as handle:
                inner = handle.read(348)
        except (OSError, EOFError, zlib.error):  # gzip's magic, then no valid deflate stream
            return "unknown"
        if _is_nifti(inner):
            return "nifti"
    return "unknown"


def _is_nifti(head: bytes) -> bool:
    """NIfTI-1 ('n+1' at byte 344) or NIfTI-2 ('n+2' and its line-ending check bytes at byte 4)."""
    return head[344:348] in (b"n+1\x00", b"ni1\x00") or head[4:12] == b"n+2\x00\r\n\x1a\n"


def _safe_member(name: str) -> PurePosixPath | None:
    """The relative path of a zip member, or None for members that would escape the target folder."""
    normalised = name.replace("\\", "/")
    if normalised.startswith("/") or (len(normalised) > 1 and normalised[1] == ":"):
        return None
    parts = PurePosixPath(normalised).parts
    if any(part == ".." for part in parts):
        return None
    return PurePosixPath(*[p for p in parts if p not in ("", ".")]) if parts else PurePosixPath()


def extract_zip(archive: Path, dest: Path, max_bytes: int) -> int:
    """Extract a zip of DICOM files to `dest`, refusing members that escape it (zip slip), symlinks and archives
    that expand past `max_bytes`. Returns the number of files extracted."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        zf = zipfile.ZipFile(archive)
    # Also a damaged central directory: a member name flagged UTF-8 that is not, a "version needed" zipfile does
    # not support.
    except (zipfile.BadZipFile, UnicodeDecodeError, NotImplementedError) as error:
        raise ApiError(400, "bad_zip", f"not a readable zip file: {error}") from error
    with zf:
        members = zf.infolist()
        first_named: dict[tuple[str, ...], zipfile.ZipInfo] = {}
        for info in members:
            rel = _safe_member(info.filename)
            if rel is None:
                raise ApiError(400, "zip_slip", f"zip member {info.filename!r} points outside the study folder")
            if stat.S_ISLNK(info.external_attr >> 16):
                raise ApiError(400, "zip_slip", f"zip member {info.filename!r} is a symbolic link")
            if not info.is_dir() and (earlier := first_named.setdefault(rel.parts, info)) is not info:
                # Extracting both would keep only the last: a study silently short of files.
                raise ApiError(400, "bad_zip", f"zip member {info.filename!r} has the path of an earlier member "
                               f"({earlier.filename!r}); expected each file once")
        if sum(i.file_size for i in members) > max_bytes:
            raise ApiError(413, "zip_too_large", f"zip expands past the limit of {max_bytes} bytes")
        count = 0
        for info in members:
            rel = _safe_member(info.filename)
            if info.is_dir() or rel is None or not rel.parts or rel.parts[0] == "__MACOSX":
                continue
            target = dest.joinpath(*rel.parts)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, 1024 * 1024)
            except (FileExistsError, NotADirectoryError, IsADirectoryError) as error:  # `a`, then `a/b`
                raise ApiError(400, "bad_zip", f"zip member {info.filename!r} clashes with another member's path: "
                               f"{error.strerror}") from error
            except (RuntimeError, NotImplementedError) as error:  # encrypted, unsupported compression method
                raise ApiError(400, "bad_zip", f"zip member {info.filename!r} cannot be extracted: {error}") from error
            except (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError) as error:  # CRC, truncated, corrupt
                raise _damaged(info.filename, error) from error
            except OSError as error:
                raise _member_os_error(info.filename, error) from error
            count += 1
    if count == 0:
        raise ApiError(400, "empty_input", "the zip holds no files")
    return count


def _damaged(name: str, error: Exception) -> ApiError:
    return ApiError(400, "bad_zip", f"zip member {name!r} is damaged: {error}")


def _member_os_error(name: str, error: OSError) -> ApiError:
    """An OSError while a member is extracted: a corrupt bzip2 stream (no errno) or a member offset before the
    archive's start (a seek's EINVAL), a name the file system refuses (the client's), or the server's own disk
    (full: 507; anything else: 500)."""
    if error.errno in (None, errno.EINVAL):
        return _damaged(name, error)
    if error.errno == errno.ENAMETOOLONG:
        return ApiError(400, "bad_zip", f"zip member {name!r} has a name too long for the file system (each part "
                        "of the path may have at most 255 bytes)")
    log.error("cannot store zip member %r: %s", name, error)
    if disk_full(error):
        return insufficient_storage("this study")
    return ApiError(500, "input_failed", f"the server could not store zip member {name!r}: {error.strerror}")


def _check_dicom_folder(folder: Path) -> None:
    """Every file must at least look like DICOM; the core reports the finer problems (truncation, geometry)."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    if not files:
        raise ApiError(400, "empty_input", "no files were sent")
    for path in files:
        if sniff(path) != "dicom":
            rel = path.relative_to(folder)
            raise ApiError(400, "not_dicom", f"{rel} is not a DICOM file ({NOT_DICOM})")


def stage_file(path: Path, dest: Path, max_bytes: int, link: bool = False, name: str | None = None) -> InputSpec:
    """A single received file (tus upload, raw body, or a form's one file part, `name` then its safe file name)
    -> InputSpec, by content."""
    if path.stat().st_size == 0:
        raise ApiError(400, "empty_input", "the body is empty: expected DICOM, a zip of DICOM files or NIfTI")
    kind = sniff(path)
    dest.mkdir(parents=True, exist_ok=True)
    if kind == "zip":
        extract_zip(path, dest / "dicom", max_bytes)
        _check_dicom_folder(dest / "dicom")
        return InputSpec("dicom", dest / "dicom")
    if kind == "nifti":
        suffix = ".nii.gz" if open(path, "rb").read(2) == b"\x1f\x8b" else ".nii"  # nibabel reads gzip by name
        stem = re.sub(r"(\.nii)?(\.gz)?$", "", name or "", flags=re.IGNORECASE)
        target = dest / f"{stem or 'input'}{suffix}"  # named as the client names it, for messages about it
        _place(path, target, link)
        return InputSpec("nifti", target)
    if kind == "dicom":
        (dest / "dicom").mkdir(exist_ok=True)
        _place(path, dest / "dicom" / "0000.dcm", link)
        return InputSpec("dicom", dest / "dicom")
    raise ApiError(400, "unsupported_input", "the input is neither DICOM, a zip of DICOM files nor NIfTI")


def stage_upload(path: Path, dest: Path, max_bytes: int) -> InputSpec:
    """A finished tus upload -> InputSpec. The upload's bytes are hard-linked into `dest` first, in one step, so a
    DELETE or expiry of the upload from then on leaves this request its input; one that came before is a 404."""
    held = dest / "upload.bin"
    dest.mkdir(parents=True, exist_ok=True)
    try:
        _place(path, held, link=True)
    except FileNotFoundError as error:
        raise ApiError(404, "unknown_upload", f"upload {path.stem!r} was removed before it could be used") from error
    try:
        return stage_file(held, dest, max_bytes, link=True)
    finally:
        held.unlink()


def _place(src: Path, dst: Path, link: bool) -> None:
    """Hard-link when asked (tus uploads: no copy, and the job keeps its input even if the upload expires)."""
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)


def _stage_parts(parts: list[FilePart], raw: Path, dest: Path, max_bytes: int) -> InputSpec:
    """The saved file parts as the input: one zip or NIfTI file staged as such, else DICOM files, every one."""
    if len(parts) == 1 and sniff(parts[0].path) in ("zip", "nifti"):
        spec = stage_file(parts[0].path, dest, max_bytes, True, name=parts[0].path.name)
        shutil.rmtree(raw)  # extracted, or hard-linked into place
        return spec
    for index, part in enumerate(parts):
        if sniff(part.path) != "dicom":
            raise ApiError(400, "not_dicom", f"{part.filename or f'part {index}'} is not a DICOM file ({NOT_DICOM})")
    raw.rename(dest / "dicom")
    return InputSpec("dicom", dest / "dicom")


def _part_name(filename: str | None, index: int) -> str:
    """A file name for a received part: the client's own (its last component, in safe characters), so that
    errors about the file name it as the client does."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", PurePosixPath((filename or "").replace("\\", "/")).name).lstrip(".")
    return name[:128] or f"part-{index:06d}"


def _check_encoding(request: Request) -> None:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # read as is, a gzip-encoded body fails later, and misleadingly
        raise ApiError(415, "unsupported_media_type", f"Content-Encoding {shown(encoding)} is not supported; send "
                       "the body unencoded (a zip or .nii.gz is compressed already)")


async def input_json(request: Request) -> dict[str, Any]:
    """A JSON input body: `upload` or `study`/`series`/`store`, and options; any other field is refused (a
    misspelt option would otherwise be dropped without a word)."""
    _check_encoding(request)
    body = await json_object(request)
    unknown = sorted(set(body) - set(OPTION_FIELDS) - set(JSON_INPUT_FIELDS))
    if unknown:
        raise ApiError(400, "bad_json", f"unknown field(s) {', '.join(shown(k) for k in unknown)}; expected "
                       f"{', '.join(JSON_INPUT_FIELDS + OPTION_FIELDS)}")
    return body


async def json_object(request: Request) -> dict[str, Any]:
    """A JSON body that must be an object ({"upload": ID}, {"study": UID, ...}); 400 bad_json otherwise."""
    try:
        body = await limited(request, MAX_JSON_BYTES).json()
    except (ValueError, RecursionError) as error:  # RecursionError: nesting deeper than the parser goes
        raise ApiError(400, "bad_json", f"request body is not JSON: {error}") from error
    if not isinstance(body, dict):
        raise ApiError(400, "bad_json", "request body must be a JSON object")
    return body


def limited(request: Request, max_bytes: int) -> Request:
    """The same request, refusing a body over `max_bytes` with 413: at once when Content-Length says so, else
    as soon as the bytes received pass the limit (chunked bodies, parsers that read the whole body)."""
    declared = header_int(request.headers.get("content-length"))
    if declared is not None and declared > max_bytes:
        raise ApiError(413, "body_too_large", f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    received = 0

    async def receive() -> Message:
        nonlocal received
        message = await request.receive()
        received += len(message.get("body", b""))
        if received > max_bytes:
            raise ApiError(413, "body_too_large", f"request body exceeds the limit of {max_bytes} bytes")
        return message

    return Request(request.scope, receive)


async def remove_folder(folder: Path) -> None:
    """A request's folder removed off the event loop (100,000 parts took 0.9 s, every other request waiting),
    shielded: it runs on the way out of a cancelled request too."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(shutil.rmtree, folder, True)


async def _save_body(request: Request, target: Path, max_bytes: int) -> None:
    size = 0
    idle_seconds = services(request).config.upload_idle_seconds
    try:
        with open(target, "wb") as out:
            async with contextlib.aclosing(body_chunks(limited(request, max_bytes), idle_seconds)) as chunks:
                async for chunk in chunks:
                    size += len(chunk)
                    await anyio.to_thread.run_sync(out.write, chunk)
    except ClientDisconnect as error:
        raise ApiError(400, "truncated_body", "the client disconnected before the body was complete") from error
    except TimeoutError as error:
        raise stalled(idle_seconds) from error
    declared = header_int(request.headers.get("content-length"))
    if declared is not None and declared != size:
        raise ApiError(400, "truncated_body", f"received {size} of {declared} declared bytes")


def _check_uid(body: dict[str, Any], field: str, level: str) -> None:
    """A DICOMweb reference becomes part of the store's URL: only well-formed UIDs get that far."""
    value = body[field]
    if not isinstance(value, str) or len(value) > 64 or not UID_RE.fullmatch(value):
        raise ApiError(400, "bad_reference", f"{field!r} must be a {level} Instance UID (digits and dots, at most "
                       f"64 characters), not {value!r}")


def request_options(request: Request, body_fields: Iterable[tuple[str, Any]] = ()) -> dict[str, Any]:
    """The options (`format`, `writeback`, `model`) a request gives in its query string and beside its input
    (form or JSON fields), together. One given more than once with different values is a 400 naming both, not a
    silent pick of the first or the last."""
    options: dict[str, Any] = {}
    for key, value in (*request.query_params.multi_items(), *body_fields):
        if key not in OPTION_FIELDS:
            continue
        if key in options and _comparable(key, options[key]) != _comparable(key, value):
            raise ApiError(400, "bad_parameter", f"{key!r} is given more than once, as {shown(options[key])} and "
                           f"{shown(value)}; give it once")
        options[key] = value
    return options


def _comparable(key: str, value: Any) -> Any:
    """`writeback` given twice may be spelled two ways: `?writeback=true` and JSON `true` agree. Names and formats
    are compared as given."""
    if key != "writeback":
        return value
    if isinstance(value, bool):
        return str(value).lower()
    return value.strip().lower() if isinstance(value, str) else value


def media_type(request: Request) -> str:
    """The request's Content-Type without its parameters, lower-cased ("" when there is none)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


Check = Callable[[dict[str, Any]], object]
RAW_BODY_TYPES = ("application/zip", "application/dicom", "application/octet-stream", "application/gzip",
                  "application/x-nifti")


async def parse_input(request: Request, dest: Path, max_bytes: int,
                      check: Check | None = None) -> tuple[InputSpec, dict[str, Any]]:
    """Read the request into `dest`; returns the input and the options found beside it (format, writeback,
    model). `check(options)` runs as soon as the options are known, before the study is stored or extracted,
    and may raise to refuse the request (an unknown model) without that work."""
    check = check or (lambda options: None)
    _check_encoding(request)
    dest.mkdir(parents=True, exist_ok=True)
    content_type = media_type(request)
    if content_type == "application/json":
        return await _json_input(request, dest, max_bytes, check)
    if content_type == "multipart/form-data":
        return await _multipart_input(request, dest, max_bytes, check)
    if content_type in RAW_BODY_TYPES:
        options = request_options(request)
        check(options)
        target = dest / "body"
        await _save_body(request, target, max_bytes)
        spec = await anyio.to_thread.run_sync(stage_file, target, dest, max_bytes, True)
        target.unlink()  # extracted, or hard-linked into place
        return spec, options
    raise ApiError(415, "unsupported_media_type",
                   f"Content-Type {shown(content_type) if content_type else '(none)'} is not taken: send "
                   "multipart/form-data files, a zip/DICOM/NIfTI body, or JSON {upload} / {study, series}")


async def _json_input(request: Request, dest: Path, max_bytes: int,
                      check: Check) -> tuple[InputSpec, dict[str, Any]]:
    """`{"upload": ID}` (a finished tus upload, staged into `dest`) or `{"study": UID, "series": UID?}` (a
    reference into the configured DICOMweb store, pulled later)."""
    body = await input_json(request)
    options = request_options(request, body.items())
    check(options)
    if "upload" in body and "study" in body:
        raise ApiError(400, "bad_json", "give either 'upload' (a tus upload) or 'study' (a DICOMweb reference), "
                       "not both")
    if "upload" in body:
        if not isinstance(body["upload"], str):
            raise ApiError(400, "bad_json", f"'upload' must be the id of a tus upload (a string), not "
                           f"{shown(body['upload'])}")
        path = services(request).uploads.finished(body["upload"])
        spec = await anyio.to_thread.run_sync(stage_upload, path, dest, max_bytes)
        return spec, options
    if "study" in body:
        _check_uid(body, "study", "Study")
        series = body.get("series")
        if series is not None:
            _check_uid(body, "series", "Series")
        configured = services(request).config.dicomweb_url
        if not configured:
            raise ApiError(400, "no_dicomweb", "this server has no DICOMweb store configured (--dicomweb)")
        named = body.get("store")
        ours = without_credentials(configured.rstrip("/"))
        if named and without_credentials(str(named).rstrip("/")) != ours:
            # Only the configured store is ever contacted: a client cannot make the server fetch any URL. Its
            # credentials are the server's: a client names the store without them, and is never shown them.
            raise ApiError(400, "unknown_store", f"this server reads only from {ours}, not "
                           f"{without_credentials(str(named))}")
        return InputSpec("dicomweb", study=body["study"], series=series), options
    raise ApiError(400, "bad_json", "expected {\"upload\": ID} or {\"study\": UID, \"series\": UID?}")


async def _multipart_input(request: Request, dest: Path, max_bytes: int,
                           check: Check) -> tuple[InputSpec, dict[str, Any]]:
    """Files as form parts, each written to disk as it arrives, beside option fields (a `model` field is checked
    as soon as it is read, before the files after it)."""
    _, parameters = parse_options_header(request.headers.get("content-type", ""))
    if not parameters.get(b"boundary"):
        raise ApiError(400, "bad_multipart", "the multipart Content-Type has no boundary")
    raw = dest / "parts"
    raw.mkdir(exist_ok=True)
    fields: list[tuple[str, str]] = []

    def on_field(key: str, value: str) -> None:
        if key not in OPTION_FIELDS:  # a file part without a filename, or a misspelt option
            raise ApiError(400, "bad_multipart", f"form field {shown(key)} is not a file part (it has no "
                           f"filename) nor one of {', '.join(OPTION_FIELDS)}; send files as file parts: "
                           "curl -F 'files=@PATH'")
        fields.append((key, value))
        if key == "model":  # an unknown model is refused before the study's files are read
            check(request_options(request, fields))

    reader = MultipartReader(parameters[b"boundary"], body_charset(parameters), raw, _part_name, on_field,
                             MAX_FORM_FILES)
    idle_seconds = services(request).config.upload_idle_seconds
    try:
        parts = await reader.read(body_chunks(limited(request, max_bytes), idle_seconds))
    except TimeoutError as error:
        raise stalled(idle_seconds) from error
    options = request_options(request, fields)
    check(options)
    if not parts:
        raise ApiError(400, "empty_input", "the multipart body holds no files")
    return await anyio.to_thread.run_sync(_stage_parts, parts, raw, dest, max_bytes), options
