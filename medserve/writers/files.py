"""Result files appear complete or not at all."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from medserve.errors import OutputError, first_line


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; on success it is renamed to `path`.

    The temporary name keeps `path`'s suffixes (nibabel picks the format from them). When writing fails, the
    temporary file is removed; an OSError (folder not writable, disk full) becomes an OutputError naming `path`.
    """
    partial = path.with_name(f".{path.name}.partial{''.join(path.suffixes)}")
    try:
        yield partial
        partial.replace(path)
    except BaseException as error:
        with contextlib.suppress(OSError):  # the original error is the one to report
            partial.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OutputError(f"cannot write {path}: {_reason(error)}") from error
        raise


def _reason(error: OSError) -> str:
    """The OS's reason in one line. pydicom re-raises a write error as an OSError whose text holds the whole
    traceback (and no strerror); the original error is its cause."""
    for candidate in (error, error.__cause__, error.__context__):
        if isinstance(candidate, OSError) and candidate.strerror:
            return candidate.strerror
    return first_line(error)
