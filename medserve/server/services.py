"""The server's long-lived objects, shared by every route: one typed `Services` on `app.state.services`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request

if TYPE_CHECKING:  # at run time these import the modules that import this one (jobs -> inputs -> services)
    from medserve.server.auth import Authenticator
    from medserve.server.config import ServerConfig
    from medserve.server.jobs import JobQueue
    from medserve.server.metrics import Metrics
    from medserve.server.store import ModelStore
    from medserve.server.uploads import UploadStore


@dataclass(frozen=True)
class Services:
    config: ServerConfig
    store: ModelStore
    jobs: JobQueue
    uploads: UploadStore
    metrics: Metrics
    auth: Authenticator


def services(request: Request) -> Services:
    """The `Services` of the app serving `request`."""
    return request.app.state.services
