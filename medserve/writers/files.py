"""Result files appear complete or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from medserve.errors import OutputError, first_line

# Held while a finished file is renamed into place, and for good once the process is ending (stop_publishing).
_PUBLISHING = threading.Lock()


# A published file's identity: its inode, and its mtime against the inode's reuse. Another run that removes the
# file and writes its own under the name often gets the freed inode back.
FileIdentity = tuple[int, int, int]
# The files this process has published, with their identities, when it keeps track (`track_published`).
_published: list[tuple[Path, FileIdentity]] | None = None


def partial_path(path: Path) -> Path:
    """Where `path` is written before it is complete: a hidden name beside it, keeping its suffixes, with this
    process's id (two runs writing into one folder must not write into one file)."""
    return path.with_name(f".{path.name}.{os.getpid()}.partial{''.join(path.suffixes)}")


def track_published() -> list[tuple[Path, FileIdentity]]:
    """From now on keep the files this process publishes (path, identity), and return that list: an app that runs
    once removes exactly its own results when it fails (`remove_published`), not those another run finished
    into the same folder meanwhile, under the same names. Not for a server, whose list would grow without end."""
    global _published
    _published = []
    return _published


def remove_published(published: list[tuple[Path, FileIdentity]]) -> None:
    """Remove the files of `published` that are still the ones this process wrote there."""
    for path, identity in published:
        with contextlib.suppress(OSError):
            if _identity(path.stat()) == identity:
                path.unlink()


def _identity(status: os.stat_result) -> FileIdentity:
    return status.st_dev, status.st_ino, status.st_mtime_ns


def _abandoned_partials(path: Path) -> list[Path]:
    """Partial files of `path` whose process has ended without removing them (killed outright, out of memory),
    and those of versions that named them without a process id."""
    found = list(path.parent.glob(f".{path.name}.partial*"))
    for candidate in path.parent.glob(f".{path.name}.*.partial*"):
        pid = candidate.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit() or not _alive(int(pid)):
            found.append(candidate)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def writable_folder(folder: Path, stale: Sequence[str] = ()) -> list[Path]:
    """Make `folder` (and its missing parents), check that this process can write in it, whatever the permission
    bits say, and remove the files named `stale` there with their partial files (an earlier run's results, which
    must not pass for this run's). Returns the folders it made, deepest first; an OutputError naming the folder
    when it cannot be made or written."""
    try:
        created = [f for f in (folder, *folder.absolute().parents) if not f.exists()]
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        for name in stale:
            (folder / name).unlink(missing_ok=True)
            # A run killed outright (SIGKILL, out of memory) leaves its partial file; inside an input folder it
            # would be read as a corrupt DICOM file by every later run.
            for partial in _abandoned_partials(folder / name):
                partial.unlink(missing_ok=True)
    except OSError as error:
        try:
            exists = folder.is_dir()
        except OSError:  # a name too long, a parent we may not search
            exists = False
        raise OutputError(f"output folder {folder}: cannot be {'written to' if exists else 'created'} "
                          f"({error.strerror or error}); expected a folder we can write to") from error
    return created


def stop_publishing() -> None:
    """From now on no result file of this process appears under its name: a rename in progress finishes first,
    every later one waits for ever. For a process that is ending and removes its results."""
    _PUBLISHING.acquire()


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to; on success it is renamed to `path`.

    The temporary name (`partial_path`) keeps `path`'s suffixes (nibabel picks the format from them). When writing
    fails, the temporary file is removed; an OSError (folder not writable, disk full) becomes an OutputError naming
    `path`.
    """
    partial = partial_path(path)
    try:
        yield partial
        with _PUBLISHING:
            if _published is not None:
                _published.append((path, _identity(partial.stat())))  # a rename keeps inode and mtime
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
