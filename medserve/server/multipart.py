"""Multipart form bodies streamed to disk: each file part straight into a file of its own, closed as the part
ends, each text field checked as it ends.

Starlette's form parser keeps every part under 1 MiB in memory and every part's file open until the whole form
is read: a CT slice is about 0.5 MiB, so a study of 2,000 slices was held whole in memory (and a study of larger
slices as that many open files)."""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import anyio
from python_multipart.multipart import FormParserError, MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

from medserve.server.errors import ApiError, shown

MAX_FIELD_BYTES = 64 * 1024  # an option's value; more is a file sent without a filename
MAX_FIELDS = 100
_WRITE_BATCH = 1024 * 1024  # part data handed to a worker thread in writes of about this much
_FILES_PER_BATCH = 64  # and files closed at least this often, so that few are open at once


@dataclass
class FilePart:
    """A file part as saved: the client's file name (None when it sent none) and where its bytes are."""

    filename: str | None
    path: Path


@dataclass
class _Part:
    disposition: bytes = b""
    header_name: bytes = b""
    header_value: bytes = b""
    name: str = ""
    file: FilePart | None = None
    handle: BinaryIO | None = None
    value: bytearray = field(default_factory=bytearray)


class MultipartReader:
    """One multipart/form-data body into `folder`: file parts as files named by `name_file(filename, index)`
    (unique names), text fields passed to `on_field(name, value)` as each ends (it may raise to refuse the
    request before the rest is read)."""

    def __init__(self, boundary: bytes, charset: str, folder: Path, name_file: Callable[[str | None, int], str],
                 on_field: Callable[[str, str], None], max_files: int) -> None:
        self.charset = charset
        self.folder = folder
        self.name_file = name_file
        self.on_field = on_field
        self.max_files = max_files
        self.files: list[FilePart] = []
        self.fields = 0
        self.ended = False  # the close delimiter was read: the body is whole
        self._taken: set[str] = set()
        self._part = _Part()
        self._pending: list[tuple[_Part, bytes]] = []  # file data not yet written
        self._pending_bytes = 0
        self._finished: list[_Part] = []  # file parts whose data has all been handed over
        self._open: list[_Part] = []
        self.boundary = boundary

    async def read(self, stream: AsyncIterator[bytes]) -> list[FilePart]:
        """Read `stream` (closed when done); the file parts saved. A TimeoutError or ClientDisconnect of the stream
        is raised as it is."""
        try:
            parser = MultipartParser(self.boundary, {  # FormParserError for a boundary over 256 bytes
                "on_part_begin": self._begin, "on_header_field": self._header_name,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished, "on_part_data": self._data, "on_part_end": self._end,
                "on_end": self._body_end})
            async with contextlib.aclosing(stream) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    parser.write(chunk)
                    if self._pending_bytes >= _WRITE_BATCH or len(self._finished) >= _FILES_PER_BATCH:
                        await anyio.to_thread.run_sync(self._flush)
            parser.finalize()
            await anyio.to_thread.run_sync(self._flush)
        except ClientDisconnect as error:
            raise ApiError(400, "truncated_body", "the client disconnected during the upload") from error
        except FormParserError as error:
            raise ApiError(400, "bad_multipart", f"cannot parse the multipart body: {error}") from error
        finally:
            for part in self._open:  # a refusal or a failure: the caller removes the folder
                part.handle.close()  # type: ignore[union-attr]
            self._open.clear()
        if not self.ended:
            raise ApiError(400, "truncated_body", "the multipart body ends before its closing boundary "
                           "('--BOUNDARY--'): it was cut short, and the parts it holds may not be the whole study")
        return self.files

    def _flush(self) -> None:
        for part, data in self._pending:
            if part.handle is None:
                part.handle = open(part.file.path, "xb")  # type: ignore[union-attr]
                self._open.append(part)
            part.handle.write(data)
        for part in self._finished:
            if part.handle is None:  # an empty file part
                part.handle = open(part.file.path, "xb")  # type: ignore[union-attr]
                self._open.append(part)
            part.handle.close()
            self._open.remove(part)
        self._pending.clear()
        self._pending_bytes = 0
        self._finished.clear()

    def _begin(self) -> None:
        self._part = _Part()

    def _header_name(self, data: bytes, start: int, end: int) -> None:
        self._part.header_name += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._part.header_value += data[start:end]

    def _header_end(self) -> None:
        if self._part.header_name.lower() == b"content-disposition":
            self._part.disposition = self._part.header_value
        self._part.header_name = self._part.header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._part.disposition)
        if b"name" not in options:
            raise ApiError(400, "bad_multipart", "a part has no Content-Disposition name")
        self._part.name = self._decode(options[b"name"])
        if b"filename" not in options:
            self.fields += 1
            if self.fields > MAX_FIELDS:
                raise ApiError(400, "bad_multipart", f"more than {MAX_FIELDS} form fields")
            return
        if len(self.files) >= self.max_files:
            raise ApiError(400, "bad_multipart", f"more than {self.max_files} files in one request")
        filename = self._decode(options[b"filename"])
        name = self.name_file(filename, len(self.files))
        clash = 0
        while name in self._taken:  # parts with the same name (or one named like a renamed one)
            clash += 1
            name = f"{len(self.files):06d}-{clash}-{self.name_file(filename, len(self.files))}"
        self._taken.add(name)
        self._part.file = FilePart(filename or None, self.folder / name)
        self.files.append(self._part.file)

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._part.file is not None:
            self._pending.append((self._part, data[start:end]))
            self._pending_bytes += end - start
            return
        if len(self._part.value) + end - start > MAX_FIELD_BYTES:
            raise ApiError(400, "bad_multipart", f"form field {shown(self._part.name)} is over {MAX_FIELD_BYTES} "
                           "bytes; send files as file parts with a filename")
        self._part.value += data[start:end]

    def _end(self) -> None:
        if self._part.file is not None:
            self._finished.append(self._part)
        else:
            self.on_field(self._part.name, self._decode(bytes(self._part.value)))

    def _body_end(self) -> None:
        self.ended = True

    def _decode(self, value: bytes) -> str:
        try:
            return value.decode(self.charset)
        except UnicodeDecodeError:
            return value.decode("latin-1")


def body_charset(parameters: dict[bytes, bytes]) -> str:
    charset = parameters.get(b"charset", b"utf-8").decode("latin-1")
    try:
        return codecs.lookup(charset).name
    except LookupError:
        return "latin-1"
