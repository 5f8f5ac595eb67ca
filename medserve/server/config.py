"""Server settings: one dataclass, filled from the CLI (or tests) and passed to `create_app`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from medserve.server.lock import DATABASE


@dataclass
class ServerConfig:
    """Everything the server needs to know; defaults match `medserve serve` without flags."""

    store: Path = Path("bundles")
    data_dir: Path = Path(".medserve")
    host: str = "127.0.0.1"
    port: int = 8000
    # Auth: a tokens file (one `TOKEN SCOPE[,SCOPE]` per line) and/or MEDSERVE_TOKENS in the environment.
    tokens_file: Path | None = None
    insecure: bool = False
    # Store: polling watcher and the half-copy rule (a folder is loaded only after every file's size and mtime
    # stayed unchanged for `stable_seconds`).
    poll_interval: float = 1.0
    stable_seconds: float = 2.0
    # LRU budget: number of loaded models and/or bytes of parameters+buffers; None means unbounded.
    max_models: int | None = None
    max_memory_bytes: int | None = None
    preload: list[str] = field(default_factory=list)  # model names, or ["all"]
    device: str | None = None
    # Per-model admission: `concurrency` requests run at once, `queue_size` more may wait, the rest get 429.
    concurrency: int = 1
    queue_size: int = 16
    queue_timeout: float = 300.0
    # Jobs: worker threads pulling from the SQLite queue; interrupted jobs are retried up to `job_max_attempts`.
    job_workers: int = 1
    job_max_attempts: int = 2
    # Finished jobs (their record and result) are removed this long after they ended; None keeps them.
    job_retention_seconds: float | None = None
    # Uploads (tus): maximum declared length and lifetime of an unfinished or unused upload.
    max_upload_bytes: int = 4 * 1024**3
    upload_expiry_seconds: float = 24 * 3600.0
    # A PATCH whose body stops arriving for this long ends (its bytes kept, its lock given back): a dropped link
    # that TCP never reports would otherwise lock the upload against every resume, DELETE and expiry.
    upload_idle_seconds: float = 60.0
    # DICOMweb store the `{study, series}` inputs refer to, and the retry policy jobs use when it is down.
    dicomweb_url: str | None = None
    dicomweb_timeout: float = 30.0
    dicomweb_retries: int = 4
    dicomweb_backoff: float = 1.0
    # Browser apps on these origins (scheme://host[:port], or "*") may call the server (medserve.server.cors).
    cors_origins: list[str] = field(default_factory=list)

    @property
    def uploads_dir(self) -> Path:
        return self.data_dir / "uploads"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @property
    def tmp_dir(self) -> Path:
        return self.data_dir / "tmp"

    @property
    def db_path(self) -> Path:
        return self.data_dir / DATABASE
