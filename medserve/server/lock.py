"""One `medserve serve` per data dir. A second server on the same folder would run the restart recovery on the
first one's live jobs (requeue them, delete their folders) before it even learns that its port is taken, so the
data dir is taken first, with an exclusive lock held for the server's life."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from medserve.errors import MedserveError

LOCK_FILE = "serve.lock"


class DataDirInUse(MedserveError):
    """Another running server holds the data dir."""


def lock_data_dir(data_dir: Path) -> IO[str]:
    """An exclusive flock on `data_dir/serve.lock`, held until the returned file is closed. The kernel drops it
    when the process dies, so a killed server leaves no stale lock behind. The file holds the holder's pid, for
    the refusal's message."""
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = open(data_dir / LOCK_FILE, "a+")  # not "w": that would erase the holder's pid before we know
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
    return handle
