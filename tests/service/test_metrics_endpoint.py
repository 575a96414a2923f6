"""The /metrics endpoint's final scrape, in-process: once drained it waits for one scrape of the
final values (which says so: posenc_drained 1), and no longer than it was told."""

from __future__ import annotations

import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Gauge

from service.metrics_endpoint import MetricsEndpoint
from service.process import free_port


def endpoint() -> tuple[MetricsEndpoint, Counter, str]:
    registry = CollectorRegistry()
    drained = Gauge("posenc_drained", "drained", registry=registry)
    calls = Counter("posenc_calls", "calls", registry=registry)
    port = free_port()
    return (
        MetricsEndpoint("127.0.0.1", port, lambda: None, drained, registry),
        calls,
        f"http://127.0.0.1:{port}/metrics",
    )


def scrape(url: str) -> list[str]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode().splitlines()


def test_a_drained_server_waits_for_one_scrape_of_its_final_counts() -> None:
    served, calls, url = endpoint()
    try:
        calls.inc(3)
        assert "posenc_drained 0.0" in scrape(url)  # a scrape before the drain ends is not the final one
        scraped: list[bool] = []
        waiting = threading.Thread(target=lambda: scraped.append(served.serve_final_values(60)))
        waiting.start()
        time.sleep(0.2)
        assert waiting.is_alive()  # waits for the scrape
        final = scrape(url)
        waiting.join(timeout=5)
        assert scraped == [True]
        assert "posenc_drained 1.0" in final and "posenc_calls_total 3.0" in final
    finally:
        served.shutdown()


def test_without_a_scrape_it_waits_no_longer_than_told() -> None:
    served, _, _ = endpoint()
    try:
        started = time.monotonic()
        assert served.serve_final_values(0.3) is False
        assert 0.3 <= time.monotonic() - started < 2
        assert served.serve_final_values(0) is False  # 0: not at all
    finally:
        served.shutdown()
