"""The FastAPI application: `create_app(config)` makes the shared services, then mounts the routers (health,
/v1/models, /v1/jobs, tus uploads, OIP /v2) and the error handlers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import sqlite3
from collections.abc import AsyncIterator

import anyio
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from medserve.errors import MedserveError
from medserve.server import cors, health, jobs_api, maps, models_api, oip, uploads
from medserve.server.auth import Authenticator, load_tokens
from medserve.server.config import ServerConfig
from medserve.server.errors import (ApiError, api_error_handler, core_error_handler, database_error_handler,
                                    http_error_handler, internal_error_handler, os_error_handler,
                                    validation_error_handler)
from medserve.server.jobs import JobQueue
from medserve.server.lock import UnusableDataDir, lock_data_dir
from medserve.server.metrics import Metrics
from medserve.server.services import Services
from medserve.server.store import ModelStore
from medserve.server.uploads import UploadStore

log = logging.getLogger("medserve.server.app")

ROUTERS = (uploads.router, oip.router, health.router, models_api.router, jobs_api.router)


def create_app(config: ServerConfig) -> FastAPI:
    """The app, with the data dir taken for this process (DataDirInUse when another server holds it) before
    anything in it is cleaned up or recovered; the lifespan's end gives it back."""
    data_lock = lock_data_dir(config.data_dir)
    jobs: JobQueue | None = None
    try:
        for folder in (config.data_dir, config.uploads_dir, config.jobs_dir, config.tmp_dir):
            folder.mkdir(parents=True, exist_ok=True)
        metrics = Metrics()
        store = ModelStore(config, on_change=metrics.store_changed)
        try:
            jobs = JobQueue(config, store, metrics)
        except sqlite3.DatabaseError as error:  # damaged, not a database, or read-only: before anything is removed
            remedy = ("make it writable" if "readonly" in str(error) else
                      "restore it, or move it and jobs/ away to start afresh")
            raise UnusableDataDir(f"{config.db_path}: cannot be used as the job database ({error}); {remedy}") \
                from error
        shutil.rmtree(config.tmp_dir, ignore_errors=True)  # sync-request scratch from a previous run
        config.tmp_dir.mkdir(parents=True, exist_ok=True)
        metrics.watch_jobs(jobs.counts)
        upload_store = UploadStore(config.uploads_dir, config.max_upload_bytes, config.upload_expiry_seconds,
                                   config.upload_idle_seconds)
        auth = Authenticator(load_tokens(config.tokens_file))
    except BaseException:  # a bad tokens file, say: leave the data dir free for the corrected retry
        if jobs is not None:
            jobs.close()
        data_lock.close()
        raise

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = None
        try:
            store.start()
            jobs.start()
            sweeper = asyncio.create_task(_sweep(upload_store, jobs))
            log.info("serving store %s, data in %s", config.store, config.data_dir)
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            try:
                jobs.stop()
                store.stop()
            finally:
                jobs.close()
                maps.stop_containers()  # after close: a job whose container ends now is requeued, not failed
                # A worker still in a forward pass may write into the data dir until it ends: no other server
                # may take the folder before then.
                jobs.when_workers_end(data_lock.close)

    app = FastAPI(title="medserve", version="0.1.0", lifespan=lifespan,
                  description="MONAI bundles served by folder name: DICOM in, DICOM SEG out.")
    app.state.services = Services(config, store, jobs, upload_store, metrics, auth)
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(MedserveError, core_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    # A 405's Allow is read from FastAPI's own routes (/docs, /openapi.json) and our routers' routes: an included
    # router is a single entry of the app's routes.
    routes = [*app.router.routes, *(route for router in ROUTERS for route in router.routes)]
    app.add_exception_handler(StarletteHTTPException, functools.partial(http_error_handler, routes=routes))
    app.add_exception_handler(OSError, os_error_handler)
    app.add_exception_handler(sqlite3.Error, database_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(uploads.TusProtocol)
    if config.cors_origins:
        cors.allow_origins(app, config.cors_origins)
    return app


class Server(uvicorn.Server):
    """uvicorn's server, which on being told to stop (SIGTERM, Ctrl-C) first asks the tus PATCHes in progress to
    end: each answers 503 with the offset it kept, where the grace period's end would cancel it into a bare 500
    and a logged traceback."""

    def __init__(self, config: uvicorn.Config, upload_store: UploadStore) -> None:
        super().__init__(config)
        self.upload_store = upload_store

    async def shutdown(self, sockets: list | None = None) -> None:
        self.upload_store.stop_writers()
        await super().shutdown(sockets)


async def _sweep(upload_store: UploadStore, jobs: JobQueue) -> None:
    """Expired tus uploads (the expiration extension) and finished jobs past their retention go away in the
    background."""
    while True:
        await asyncio.sleep(60)
        with contextlib.suppress(Exception):
            gone = await anyio.to_thread.run_sync(upload_store.sweep)
            if gone:
                log.info("removed %d expired uploads", gone)
        with contextlib.suppress(Exception):
            gone = await anyio.to_thread.run_sync(jobs.sweep_finished)
            if gone:
                log.info("removed %d finished jobs past their retention", gone)
