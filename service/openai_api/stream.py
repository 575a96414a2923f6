"""A request's output stream read from an asyncio loop: the engine client's reader thread wakes the
loop (call_soon_threadsafe) instead of a blocking queue, once per batch the reader has not taken."""

from __future__ import annotations

import asyncio

from service.engine.processing.streams import OutputStream, StreamEvent


class _LoopWakeup:
    """Stands in for OutputStream's wake-up queue: `put` from any thread sets an event on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        self._loop, self._event = loop, event

    def put(self, _: None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop has closed (the server stopped): nobody is reading
            pass


class AsyncOutputStream(OutputStream):
    """OutputStream's merging, awaited: `await next(timeout)` is what `get(timeout)` is to a thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._woken = asyncio.Event()
        self._wakeups = _LoopWakeup(loop, self._woken)  # type: ignore[assignment]

    async def next(self, timeout: float | None = None) -> StreamEvent | None:
        """Everything new since the last call (None on timeout); final once closed."""
        if not self._closed:
            if not self._woken.is_set():
                try:
                    async with asyncio.timeout(timeout):
                        await self._woken.wait()
                except TimeoutError:
                    return None
            self._woken.clear()
        return self.take()
