"""Runs the HTTP API on its own thread and event loop (uvloop) inside the gRPC server's process,
so both front ends share its engine client."""

from __future__ import annotations

import asyncio
import ssl
import threading

import uvloop
from aiohttp import web

from service.openai_api.app import OpenAIApi


class HttpServer:
    """Binds `host:port` (0: any free port; `port` holds the bound one once started)."""

    def __init__(self, api: OpenAIApi, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self.api, self.host, self.port, self.ssl_context = api, host, port, ssl_context
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="http", daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Bind and serve; an OSError (e.g. the port is taken) is raised here."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout)

    async def _start(self) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its request.
        self._runner = web.AppRunner(
            self.api.application(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await site.start()
        sockets = getattr(site._server, "sockets", None)
        if self.port == 0 and sockets:
            self.port = sockets[0].getsockname()[1]

    def stop(self, timeout: float = 5.0) -> None:
        """Close the port and the connections left (the engine has drained or cut their requests)."""
        if self._runner is not None and self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout)
            except Exception:  # stopping anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self.api.close()
