"""Start the real service as a subprocess on free loopback ports and talk to it (tests, bench, demo)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract.paths import REPOSITORY_ROOT
from service.api import generation_pb2_grpc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(
        self, repository: Path, *flags: str, threads: int = 1, credentials: grpc.ChannelCredentials | None = None,
        port: int | None = None, metrics_port: int | None = None, http_port: int | None = None,
    ) -> None:  # fmt: skip
        self.repository, self.flags, self.threads, self.credentials = repository, flags, threads, credentials
        self._pick_ports = port is None and metrics_port is None and http_port is None
        self._launch(port or free_port(), metrics_port or free_port(), http_port or free_port())

    def _launch(self, port: int, metrics_port: int, http_port: int) -> None:
        self.port, self.metrics_port, self.http_port = port, metrics_port, http_port
        self.target = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"  # the OpenAI-compatible API (https with TLS flags)
        command = [
            sys.executable, "-m", "service", "--model-repository", str(self.repository), "--port", str(self.port),
            "--metrics-port", str(self.metrics_port), "--http-port", str(self.http_port),
            "--threads", str(self.threads), *self.flags,
        ]  # fmt: skip
        # A file, not a pipe: nobody reads a pipe while the server runs, and a full one blocks it.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="posenc-server-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            command, cwd=REPOSITORY_ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
        credentials = self.credentials
        self.channel = (
            grpc.secure_channel(self.target, credentials) if credentials else grpc.insecure_channel(self.target)
        )
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def wait_serving(self, timeout: float = 120.0) -> ServerProcess:
        """Wait for SERVING. A free port can be taken by another process between our probe and
        the server's bind (client sockets share the ephemeral range): then start again on new ports."""
        deadline = time.monotonic() + timeout
        retries = 3
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                output = self.output()
                taken = ("Address already in use", "address already in use", "Failed to bind")
                if self._pick_ports and retries and any(text in output for text in taken):
                    retries -= 1
                    self.channel.close()
                    self._launch(free_port(), free_port(), free_port())
                    continue
                raise RuntimeError(f"server exited {self.process.returncode}: {output}")
            try:
                status = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become SERVING")

    def engine_core_pid(self) -> int | None:
        """The engine core process's pid (the server's child `python -m service.engine.core`), if running."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
                if int(fields[1]) != self.process.pid:
                    continue
                command = (stat.parent / "cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if b"service.engine.core" in command:
                return int(stat.parent.name)
        return None

    def pids(self) -> list[int]:
        """The server's processes: the front end and, while it runs, its engine core."""
        core = self.engine_core_pid()
        return [self.process.pid] + ([core] if core is not None else [])

    def memory_bytes(self, field: str = "VmRSS") -> int:
        """A /proc/PID/status memory field (VmRSS: resident now, VmHWM: peak resident), summed over
        the server's processes (the sum of peaks bounds the peak of the sum)."""
        total = 0
        for pid in self.pids():
            try:
                lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            except OSError:
                continue
            total += next((int(line.split()[1]) * 1024 for line in lines if line.startswith(f"{field}:")), 0)
        return total

    def output(self) -> str:
        """What the server printed so far."""
        return Path(self.log.name).read_text()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return self.sample([name], **labels)[name]

    def sample(self, names: list[str], **labels: str) -> dict[str, float]:
        """Several metrics from one scrape: per name (optionally with its own label selector, as in
        `name{phase="decode"}`), the sum of its samples whose labels include `labels`."""
        wanted = [(key, key.partition("{")[0], key.partition("{")[2].rstrip("}")) for key in names]
        totals: dict[str, float] = {}
        for line in self.metrics().splitlines():
            head, _, value = line.rpartition(" ")
            name = head.partition("{")[0]
            if not all(f'{k}="{v}"' in head for k, v in labels.items()):
                continue
            for key, base, selector in wanted:  # a key may select more labels: name{phase="decode"}
                if name == base and (not selector or all(part in head for part in selector.split(","))):
                    totals[key] = totals.get(key, 0.0) + float(value)
        missing = [name for name in names if name not in totals]
        if missing:
            raise KeyError(f"{', '.join(missing)} {labels} not in /metrics")
        return totals

    def stop(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll `condition` until it holds or `timeout` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
