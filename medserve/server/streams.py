"""Request bodies as they arrive, with an idle timeout. uvicorn has no body read timeout: a client whose link
dropped without a word (no FIN, no RST) would hold its request, and what the request holds (a tus upload's lock,
a folder of parts, an open file), for ever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request

from medserve.server.errors import ApiError


async def body_chunks(request: Request, idle_seconds: float) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; TimeoutError when none comes for `idle_seconds` (ClientDisconnect, as
    Starlette's own stream, when the client goes away)."""
    stream = request.stream()
    try:
        while True:
            try:
                async with asyncio.timeout(idle_seconds):  # no task per chunk, as wait_for would make
                    chunk = await anext(stream)
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        await stream.aclose()


def stalled(idle_seconds: float) -> ApiError:
    """The answer to a body that stopped arriving (the connection is closed after it)."""
    return ApiError(408, "body_stalled", f"no body bytes for {idle_seconds:g} s; the request was given up: send it "
                    "again", {"Connection": "close"})
