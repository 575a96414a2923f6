"""The /metrics endpoint: both processes' series as one exposition, served until the counters'
final values have been scraped.

A replica that drains on SIGTERM keeps counting while its running calls finish; had its endpoint
closed with the drain, whatever it counted after the last scrape would be lost to Prometheus (and
to anyone summing counters across the replica's restarts, as `increase()` does across resets).
So once the drain has finished, `posenc_drained` reads 1 (every counter holds its final value) and
the server waits for one scrape to read them, up to `--final-scrape-seconds` (a scrape interval),
before it exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Gauge, generate_latest


class CoreMetrics(Protocol):
    """What the endpoint asks of the engine client: the core's own exposition (None while it is down)."""

    def metrics_text(self) -> bytes | None: ...


class MetricsHandler(BaseHTTPRequestHandler):
    """/metrics of both processes as one exposition: this process's (RPC accounting, its own
    process and Python series) and then the engine core's, as the core wrote them (token
    latencies, steps, KV cache, its process's memory). No parsing on the way: a scrape costs a
    round trip to the core. While the core is down only this process's series are there."""

    endpoint: MetricsEndpoint

    def do_GET(self) -> None:
        if self.path.partition("?")[0] not in ("/", "/metrics"):
            self.send_error(404)
            return
        final = self.endpoint.final.is_set()  # before the exposition: it holds the final values then
        engine = self.endpoint.engine()
        body = generate_latest(self.endpoint.registry) + ((engine.metrics_text() if engine else None) or b"")
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if final:
            self.endpoint.scraped_final.set()

    def log_message(self, format: str, *args: object) -> None:
        pass  # a line per scrape would drown the log


class MetricsEndpoint:
    """The HTTP server of /metrics on its own thread; `drained` is the posenc_drained gauge."""

    def __init__(
        self, host: str, port: int, engine: Callable[[], CoreMetrics | None], drained: Gauge,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:  # fmt: skip
        self.engine, self.drained, self.registry = engine, drained, registry
        self.final = threading.Event()  # the drain has finished: the counters hold their final values
        self.scraped_final = threading.Event()  # a scrape has read them
        handler = type("Handler", (MetricsHandler,), {"endpoint": self})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="metrics", daemon=True).start()

    def serve_final_values(self, seconds: float) -> bool:
        """Mark the counters final and wait until a scrape has read them, at most `seconds`; whether one did."""
        self.drained.set(1)
        self.final.set()
        return self.scraped_final.wait(seconds) if seconds > 0 else False

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
