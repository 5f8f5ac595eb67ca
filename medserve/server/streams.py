"""Request bodies as they arrive, with an idle timeout. uvicorn has no body read timeout: a client whose link
dropped without a word (no FIN, no RST) would hold its request, and what the request holds (a tus upload's lock,
a folder of parts, an open file), for ever."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request

from medserve.server.errors import ApiError


class Interrupt:
    """Lets another request end a body being read: a tus resume taking over an upload whose PATCH went quiet
    (a client that changed networks resumes at once; waiting for the idle timeout, it was refused for a minute),
    or the server stopping. `reason` says which asked."""

    def __init__(self) -> None:
        self.reason = ""  # set by the first ask, the one the body ends for
        self._deadline: asyncio.Timeout | None = None

    @property
    def requested(self) -> bool:
        return bool(self.reason)

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason
        if self._deadline is not None and not self._deadline.expired():  # one expiring now may not be changed
            self._deadline.reschedule(asyncio.get_running_loop().time())


async def body_chunks(request: Request, idle_seconds: float,
                      interrupt: Interrupt | None = None) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; TimeoutError when none comes for `idle_seconds`, or once `interrupt` is
    requested (ClientDisconnect, as Starlette's own stream, when the client goes away)."""
    stream = request.stream()
    try:
        while True:
            try:
                async with asyncio.timeout(idle_seconds) as deadline:  # no task per chunk, as wait_for would make
                    if interrupt is not None:
                        interrupt._deadline = deadline
                        if interrupt.requested:  # asked between chunks: end if more must be waited for, not if the
                            deadline.reschedule(asyncio.get_running_loop().time())  # rest has arrived already
                    chunk = await anext(stream)
            except StopAsyncIteration:
                return
            finally:
                if interrupt is not None:
                    interrupt._deadline = None
            yield chunk
    finally:
        await stream.aclose()


def stalled(idle_seconds: float) -> ApiError:
    """The answer to a body that stopped arriving (the connection is closed after it)."""
    return ApiError(408, "body_stalled", f"no body bytes for {idle_seconds:g} s; the request was given up: send it "
                    "again", {"Connection": "close"})
