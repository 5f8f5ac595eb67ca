"""One `medserve serve` per data dir, and only on a folder that is medserve's. A second server on the same folder
would run the restart recovery on the first one's live jobs (requeue them, delete their folders) before it even
learns that its port is taken, so the data dir is taken first, with an exclusive lock held for the server's life.
A start also empties `tmp/` and removes folders under `jobs/` that no job owns: on a folder of other files
(`--data-dir .` or `$HOME`), that would delete the user's own, so such a folder is refused."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from medserve.errors import MedserveError

LOCK_FILE = "serve.lock"
DATABASE = "jobs.sqlite"
# What a server writes at the top of its data dir (the database with SQLite's journal files, the lock, the folders).
_OWN_ENTRIES = {DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm", f"{DATABASE}-journal", LOCK_FILE, "uploads", "jobs",
                "tmp"}


class DataDirInUse(MedserveError):
    """Another running server holds the data dir."""


class UnusableDataDir(MedserveError):
    """The data dir cannot be made or written (a file in its place, a read-only file system)."""


class ForeignDataDir(MedserveError):
    """The data dir holds files that a server did not write, and no job database: not a medserve data dir."""


def lock_data_dir(data_dir: Path) -> IO[str]:
    """An exclusive flock on `data_dir/serve.lock`, held until the returned file is closed. The kernel drops it
    when the process dies, so a killed server leaves no stale lock behind. The file holds the holder's pid, for
    the refusal's message. ForeignDataDir when the folder is someone else's."""
    if data_dir.exists() and not data_dir.is_dir():
        raise UnusableDataDir(f"data dir {data_dir} is a file; expected a folder (new, or one a server wrote)")
    _refuse_foreign(data_dir)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        handle = open(data_dir / LOCK_FILE, "a+")  # not "w": that would erase the holder's pid before we know
    except OSError as error:
        raise UnusableDataDir(f"data dir {data_dir}: cannot be {'written to' if data_dir.is_dir() else 'created'} "
                              f"({error.strerror or error}); expected a folder we can write to") from error
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise DataDirInUse(f"data dir {data_dir} is in use by another medserve serve (pid {holder})") from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    try:
        _refuse_lost_database(data_dir)
    except OSError as error:  # jobs/ that cannot be listed
        handle.close()
        raise UnusableDataDir(f"data dir {data_dir}: {error.filename or 'jobs'} cannot be read "
                              f"({error.strerror or error})") from error
    except BaseException:
        handle.close()
        raise
    return handle


def _refuse_lost_database(data_dir: Path) -> None:
    """Job results without the database that owns them: a start would make a new, empty database and then remove
    every folder under jobs/ as no job's, results included (a folder holding only an input is no loss: without its
    row it could never run). SQLite in WAL mode may keep a young database wholly in its -wal file, so an empty
    main file with a non-empty -wal is no loss either."""
    jobs = data_dir / "jobs"
    results = [entry for entry in jobs.iterdir() if (entry / "result").is_dir()] if jobs.is_dir() else []
    database, journal = data_dir / DATABASE, data_dir / f"{DATABASE}-wal"
    if not results or (database.exists() and (_size(database) or _size(journal))):
        return
    state = "is empty" if database.exists() else "is missing"
    raise UnusableDataDir(f"data dir {data_dir}: {DATABASE} {state} but jobs/ holds {len(results)} job result(s): a "
                          f"start would delete them as no job's; restore {DATABASE}, or move jobs/ away to start "
                          "afresh")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _refuse_foreign(data_dir: Path) -> None:
    """A data dir is medserve's when it is new, empty, holds only what a server writes, or holds a job database."""
    if not data_dir.is_dir() or (data_dir / DATABASE).exists():
        return
    foreign = sorted(entry.name for entry in data_dir.iterdir() if entry.name not in _OWN_ENTRIES)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ForeignDataDir(f"data dir {data_dir} holds files medserve did not write ({shown}) and no {DATABASE}: "
                             f"a server empties parts of its data dir at start; give --data-dir a new or empty "
                             f"folder")
