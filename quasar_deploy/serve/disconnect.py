"""Noticing that a request's client has gone, whatever the request is waiting for at that moment.

After the body, ASGI's next ``receive`` message is ``http.disconnect``: ``ClientWatch`` waits for it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .protocol import ApiError

T = TypeVar("T")


class ClientGone(Exception):
    """The request's client disconnected: nobody is left to answer (counted as status 499)."""


class ClientWatch:
    """Watches one request's client; ``ended`` is the server's: set when it ends every request (a drain's deadline)."""

    def __init__(self, receive: Callable[[], Awaitable[dict[str, Any]]], ended: asyncio.Event):
        self._gone, self._ended = asyncio.Event(), ended
        self._task = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._gone.set()

    async def until_gone(self, awaitable: Awaitable[T]) -> T:
        """What ``awaitable`` gives, unless first the client goes (``ClientGone``) or the server ends requests (503)."""
        work = asyncio.ensure_future(awaitable)
        stops = [asyncio.ensure_future(self._gone.wait()), asyncio.ensure_future(self._ended.wait())]
        try:
            await asyncio.wait([work, *stops], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for stop in stops:
                stop.cancel()
            finished = work.done()
            if not finished:
                work.cancel()
        if finished:
            return work.result()
        if self._gone.is_set():
            raise ClientGone
        raise ApiError(503, "the server is shutting down")

    def close(self) -> None:
        """The response is complete (or its stream ended): stop watching."""
        self._task.cancel()
