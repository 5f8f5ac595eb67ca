"""A writable home folder for an app run under any UID.

`medserve run` and `monai-deploy run` start a MAP's container as the host user's UID:GID, and `docker run --user`
as any other. The image's home folders belong to its own user (UID 1000), and a UID the image does not know gets
HOME=/ (docker) or the working directory (podman), neither writable by it. Libraries the SDK imports create
caches under HOME as they load (cupy's ~/.cupy), so such a run failed with a PermissionError before the app
started.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def ensure_writable_home() -> None:
    """Point HOME at a new private temporary folder, removed at exit, when it is not a folder this process can
    write to. Call it before importing the SDK."""
    home = os.path.expanduser("~")
    if os.path.isdir(home) and os.access(home, os.W_OK | os.X_OK):
        return
    temporary = tempfile.mkdtemp(prefix="medserve-home-")
    os.environ["HOME"] = temporary
    atexit.register(shutil.rmtree, temporary, ignore_errors=True)
