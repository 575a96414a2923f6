"""Debian's haproxy on loopback with the shipped deploy/haproxy/haproxy.cfg in front of replicas we
started: the proxy of the affinity tests and of the comparison's routing section.

Only the server lines differ from what ships: each `server-template` (DNS discovery) becomes one
static `server` line per replica, every other parameter kept, and the health check's port is each
replica's own HTTP port; the listen addresses and the balance come through the environment, as in
a deployment.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from contract.paths import REPOSITORY_ROOT
from service.process import wait_for

CONFIG = REPOSITORY_ROOT / "deploy" / "haproxy" / "haproxy.cfg"
BALANCE = {"affinity": "hdr(x-routing-key)", "round_robin": "roundrobin"}
TEMPLATE = re.compile(
    r'(\s*)server-template replica \S+ "\$\{POSENC_REPLICAS-server\}:(\d+)" resolvers dns init-addr none (.*)'
)


@dataclass(frozen=True)
class Replica:
    grpc: str  # host:port
    http: str  # host:port


def static_servers(shipped: str, replicas: Sequence[Replica]) -> str:
    """The shipped configuration with each server-template line replaced by the replicas' own lines."""
    lines, templates = [], 0
    for line in shipped.splitlines():
        match = TEMPLATE.fullmatch(line)
        if match is None:
            lines.append(line)
            continue
        templates += 1
        indent, port, params = match[1], match[2], match[3]
        for index, replica in enumerate(replicas, 1):
            address = replica.grpc if port == "50051" else replica.http
            check_port = replica.http.rpartition(":")[2]
            lines.append(f"{indent}server replica{index} {address} {params.replace('port 8000', f'port {check_port}')}")
    assert templates == 2, "haproxy.cfg: one server-template each for gRPC and HTTP"
    return "\n".join(lines) + "\n"


def listening_socket() -> socket.socket:
    """A loopback socket already listening, handed to haproxy as `fd@N`: a port picked and then bound
    by haproxy could meet another listener there (haproxy binds with SO_REUSEPORT, and so do gRPC
    servers), and a gRPC call then reached the HTTP frontend (CI: UNIMPLEMENTED, HTTP 404)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


class HAProxy:
    """haproxy (`binary`: its path) in the foreground; `routing`: affinity or round_robin."""

    def __init__(self, binary: str, directory: Path, replicas: Sequence[Replica], routing: str = "affinity") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        grpc_socket, http_socket = listening_socket(), listening_socket()
        self.port, self.http_port = grpc_socket.getsockname()[1], http_socket.getsockname()[1]
        self.target = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        config = directory / "haproxy.cfg"
        config.write_text(static_servers(CONFIG.read_text(), replicas))
        environment = {
            **os.environ, "POSENC_BALANCE": BALANCE[routing],
            "POSENC_GRPC_BIND": f"fd@{grpc_socket.fileno()}", "POSENC_HTTP_BIND": f"fd@{http_socket.fileno()}",
        }  # fmt: skip
        self.log = directory / "haproxy.log"
        with self.log.open("a") as log, grpc_socket, http_socket:
            self.process = subprocess.Popen(
                [binary, "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT, env=environment,
                pass_fds=(grpc_socket.fileno(), http_socket.fileno()),
            )  # fmt: skip
        if not wait_for(self._serving, timeout=10):
            self.stop()
            raise RuntimeError(f"haproxy did not start: {self.log.read_text()}")

    def _serving(self) -> bool:
        """haproxy answers on its HTTP frontend (the sockets listen from the start: a connect alone
        proves nothing)."""
        if self.process.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", self.http_port), timeout=1) as sock:
                sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                return sock.recv(12).startswith(b"HTTP/1.")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
