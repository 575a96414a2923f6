"""The /metrics endpoint's final scrape, in-process: once drained it waits for one scrape of the
final values (which says so: posenc_drained 1), and no longer than it was told."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
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
        assert served.final.wait(timeout=30)  # the values are final: the drain waits for their scrape
        assert waiting.is_alive() and not served.scraped_final.is_set()
        final = scrape(url)
        waiting.join(timeout=5)
        assert scraped == [True]
        assert "posenc_drained 1.0" in final and "posenc_calls_total 3.0" in final
    finally:
        served.shutdown()


def test_without_a_scrape_it_waits_no_longer_than_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait is the final-scrape event's own, bounded by what it was told: the test records the
    bound rather than timing an upper limit, which a shared machine would make flaky."""
    served, _, _ = endpoint()
    bounds: list[float | None] = []
    wait = served.scraped_final.wait

    def recorded(timeout: float | None = None) -> bool:
        bounds.append(timeout)
        return wait(timeout)

    monkeypatch.setattr(served.scraped_final, "wait", recorded)
    try:
        started = time.monotonic()
        assert served.serve_final_values(0.3) is False
        assert time.monotonic() - started >= 0.3 and bounds == [0.3]
        assert served.serve_final_values(0) is False and bounds == [0.3]  # 0: not at all
    finally:
        served.shutdown()
