"""SIGTERM of one of two replicas behind nginx while the project's client and Locust's gRPC user
load them: not one call fails for either.

The project's client is `python -m service.client` (service/channel.py's retry policy), run again
and again; the Locust user runs headless as the README runs it (`locust -f loadtest/locustfile.py
--headless`). Both call through Debian's nginx with the shipped configuration (loadtest.proxy).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from contract.paths import REPOSITORY_ROOT
from loadtest.proxy import Proxy
from service.process import ServerProcess, wait_for
from tests.loadtest.test_loadtest import LOCUSTFILE, request_counts

REPLICA_FLAGS = (
    "--models", "alibi", "--kv-cache-bytes", str(32 << 20), "--grace-seconds", "30", "--drain-delay-seconds", "1",
)  # fmt: skip
RUN_SECONDS = 24  # Locust's -t: the replica is stopped early in it, the rest runs on the other one


@pytest.fixture(scope="module")
def nginx(tool: Callable[[str], str]) -> str:
    return tool("nginx")


def streams_served(replica: ServerProcess) -> float:
    """GenerateStream calls the replica finished (0 before the first, or once it is gone)."""
    try:
        return replica.metric("posenc_requests_total", method="GenerateStream", code="OK")
    except (KeyError, OSError):
        return 0.0


class ClientLoop:
    """`python -m service.client` through the proxy, one run after another until stopped."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.runs: list[tuple[float, int, str]] = []  # (started, exit code, stderr)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            command = [sys.executable, "-m", "service.client", "--target", self.target, "--model", "alibi",
                       "--max-new-tokens", "16", f"x{i} = "]  # fmt: skip
            started = time.monotonic()
            result = subprocess.run(command, cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=120)
            self.runs.append((started, result.returncode, result.stderr[-1000:]))
            i += 1

    def finish(self) -> list[tuple[float, int, str]]:
        self.stop.set()
        self.thread.join(timeout=120)
        return self.runs


def test_sigterm_on_one_of_two_replicas_under_load_fails_no_call_of_our_client_or_locust(
    repository: Path, nginx: str, tmp_path: Path
) -> None:
    replicas = [ServerProcess(repository, *REPLICA_FLAGS) for _ in range(2)]  # both load at once
    proxy: Proxy | None = None
    locust: subprocess.Popen[str] | None = None
    client: ClientLoop | None = None
    try:
        leaving, staying = (replica.wait_serving() for replica in replicas)
        proxy = Proxy(nginx, tmp_path / "proxy", [replica.target for replica in replicas])
        command = [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "4", "-r", "4",
            "-t", f"{RUN_SECONDS}s", "--stop-timeout", "30", "--host", proxy.target, "--models", "alibi",
            "--prompt-bytes", "32,128", "--only-summary",
        ]  # fmt: skip
        env = {**os.environ, "LOCUST_MAX_NEW_TOKENS": "32"}
        locust = subprocess.Popen(
            command, cwd=REPOSITORY_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        client = ClientLoop(proxy.target)
        # Under load on both replicas (and our client has run once), then the SIGTERM.
        assert wait_for(lambda: min(map(streams_served, replicas)) >= 3 and bool(client.runs), timeout=60), [
            streams_served(replica) for replica in replicas
        ]
        signalled = time.monotonic()
        leaving.process.send_signal(signal.SIGTERM)
        assert leaving.process.wait(timeout=60) == 0
        served_when_gone = streams_served(staying)
        _, summary = locust.communicate(timeout=RUN_SECONDS + 120)  # Locust logs its summary to stderr
        runs = client.finish()
        served_after = streams_served(staying) - served_when_gone
    finally:
        if locust is not None and locust.poll() is None:  # the test failed before Locust ended
            locust.kill()
            locust.wait()
        if client is not None:
            client.finish()
        if proxy is not None:
            proxy.stop()
        for replica in replicas:
            replica.stop()

    assert "0 cut at the end of the grace period" in leaving.output(), leaving.output()[-2000:]
    # Locust's gRPC user: every call a success (Locust exits 1 on any failure), load on after the drain.
    counts = request_counts(summary)
    assert locust.returncode == 0, summary[-3000:]
    assert " 0(0.00%) |" in summary.split("Aggregated", 1)[1].splitlines()[0], summary[-3000:]
    assert counts["GenerateStream alibi"] > 0
    assert served_after >= 10, served_after  # the load went on, on the replica that stayed
    # The project's client: every run succeeded, some of them started while the replica drained or was gone.
    assert [(code, err) for _, code, err in runs if code != 0] == []
    assert sum(started > signalled for started, _, _ in runs) >= 2, runs
