"""Multipart bodies are streamed to disk part by part: memory and open files stay bounded whatever the study's
size (Starlette's form parser held parts under 1 MiB in memory, a whole CT study of them, until the end)."""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from medserve.server.errors import ApiError
from medserve.server.multipart import MultipartReader

BOUNDARY = b"b0undary"
PART_BYTES = 900 * 1024  # a CT slice with its header: under Starlette's 1 MiB spool limit


async def _body(parts: int, close: bool = True, field: bytes | None = None) -> AsyncIterator[bytes]:
    """`parts` file parts of PART_BYTES, generated as they are sent (in 64 KiB chunks, as uvicorn hands them)."""
    if field is not None:
        yield b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="format"\r\n\r\n' + field + b"\r\n"
    for index in range(parts):
        yield (b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="files"; filename="IM%05d.dcm"\r\n'
               b"Content-Type: application/dicom\r\n\r\n" % index)
        payload = bytes([index % 251]) * PART_BYTES
        for start in range(0, PART_BYTES, 64 * 1024):
            yield payload[start:start + 64 * 1024]
        yield b"\r\n"
    if close:
        yield b"--" + BOUNDARY + b"--\r\n"


def _reader(folder: Path, fields: list[tuple[str, str]]) -> MultipartReader:
    return MultipartReader(BOUNDARY, "utf-8", folder, lambda name, index: name or f"part-{index}",
                           lambda key, value: fields.append((key, value)), max_files=10_000)


def test_a_large_body_is_written_part_by_part_with_bounded_memory_and_files(tmp_path: Path) -> None:
    fields: list[tuple[str, str]] = []
    reader = _reader(tmp_path, fields)
    opened_before = len(os.listdir("/proc/self/fd"))
    most_open = 0
    written = reader._flush

    def counting_flush() -> None:
        nonlocal most_open
        written()
        most_open = max(most_open, len(os.listdir("/proc/self/fd")) - opened_before)

    reader._flush = counting_flush
    tracemalloc.start()
    try:
        parts = asyncio.run(reader.read(_body(200, field=b"seg")))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(parts) == 200 and fields == [("format", "seg")]
    assert peak < 16 * 1024**2, f"{peak / 1024**2:.0f} MB held for a {200 * PART_BYTES / 1024**2:.0f} MB body"
    assert most_open <= 8, most_open
    for index in (0, 117, 199):
        assert parts[index].filename == f"IM{index:05d}.dcm"
        assert parts[index].path.read_bytes() == bytes([index % 251]) * PART_BYTES


def test_a_body_without_its_close_delimiter_is_refused_and_its_files_closed(tmp_path: Path) -> None:
    reader = _reader(tmp_path, [])
    opened_before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(ApiError) as refused:
        asyncio.run(reader.read(_body(3, close=False)))
    assert refused.value.code == "truncated_body"
    assert sorted(os.listdir("/proc/self/fd")) == opened_before  # the part cut short was closed too
    assert (tmp_path / "IM00002.dcm").stat().st_size > 0


def test_a_field_refused_as_it_ends_stops_the_read(tmp_path: Path) -> None:
    def refuse(key: str, value: str) -> None:
        raise ApiError(400, "bad_parameter", f"{key}={value}")

    reader = MultipartReader(BOUNDARY, "utf-8", tmp_path, lambda name, index: name or "part", refuse, 10)
    with pytest.raises(ApiError, match="format=nifti"):
        asyncio.run(reader.read(_body(3, field=b"nifti")))
    assert list(tmp_path.iterdir()) == []  # the field came first: no file part was begun
