"""Debian's nginx on loopback with the shipped deploy/nginx/nginx.conf in front of replicas we
started: the proxy of the scale-out tests and of the chaos run (python -m loadtest.chaos).

Only two things differ from what ships: the listen addresses (free loopback ports instead of
50051 and 8000) and the included upstream.conf, which is deploy/nginx/upstream.compose.conf with
Docker's DNS name swapped for the replicas' loopback addresses (same zone, max_fails, keepalive), plus
temporary-file paths in the proxy's directory, so nginx also runs without root.
"""

from __future__ import annotations

import re
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from contract.paths import REPOSITORY_ROOT
from service.api import generation_pb2_grpc
from service.channel import open_channel
from service.process import free_port, wait_for

NGINX_DIR = REPOSITORY_ROOT / "deploy" / "nginx"
LISTEN = "listen 50051 http2;"
LISTEN_HTTP = "listen 8000;"


def static_upstream(shipped: str, targets: dict[str, list[str]]) -> str:
    """A shipped upstream file with its DNS discovery (`resolver`, `server NAME resolve ...`)
    replaced, in each upstream block, by one `server` line per fixed address of that upstream
    (`targets` by upstream name), every other parameter kept."""
    lines, servers, upstream = [], [], ""
    for line in shipped.splitlines():
        if line.strip().startswith("#") or line.strip().startswith(("resolver ", "resolver_timeout ")):
            continue
        upstream = line.split()[1] if line.startswith("upstream ") else upstream
        match = re.fullmatch(r"(\s*)server \S+ resolve(.*);", line)
        if match:
            servers.append(upstream)
            lines += [f"{match[1]}server {target}{match[2]};" for target in targets[upstream]]
        else:
            lines.append(line)
    assert servers == list(targets), shipped
    return "\n".join(lines) + "\n"


class Proxy:
    """Debian's nginx (`nginx`: its path), in the foreground, with the shipped nginx.conf and
    upstreams of our own: `targets` for gRPC, `http_targets` for the HTTP API (none: a free port
    nobody listens on). `stub` calls through it with service/channel.py's retry channel."""

    def __init__(
        self, nginx: str, directory: Path, targets: Sequence[str], http_targets: Sequence[str] = ()
    ) -> None:  # fmt: skip
        directory.mkdir(parents=True, exist_ok=True)
        self.port, self.http_port = free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        shipped = (NGINX_DIR / "nginx.conf").read_text()
        assert shipped.count(LISTEN) == 1 and shipped.count(LISTEN_HTTP) == 1
        shipped = shipped.replace(LISTEN_HTTP, f"listen 127.0.0.1:{self.http_port};")
        (directory / "nginx.conf").write_text(shipped.replace(LISTEN, f"listen {self.target} http2;"))
        kinds = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        temp = "".join(f"{kind}_temp_path {directory / kind};\n" for kind in kinds)
        http_targets = list(http_targets) or [f"127.0.0.1:{free_port()}"]
        upstreams = {"posenc_replicas": list(targets), "posenc_http_replicas": http_targets}
        upstream = static_upstream((NGINX_DIR / "upstream.compose.conf").read_text(), upstreams)
        (directory / "upstream.conf").write_text(temp + upstream)
        self.log = directory / "nginx.log"
        command = [
            nginx, "-p", str(directory), "-c", str(directory / "nginx.conf"), "-e", "stderr",
            "-g", f"daemon off; pid {directory / 'nginx.pid'};",
        ]  # fmt: skip
        with self.log.open("a") as log:  # append: nginx's access log (O_APPEND) and stderr share it
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        if not wait_for(self._listening, timeout=10):
            self.stop()
            raise RuntimeError(f"nginx did not start: {self.log.read_text()}")
        self.channel = open_channel(self.target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def _listening(self) -> bool:
        if self.process.poll() is not None:
            return False
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
        self.process.terminate()
        self.process.wait(timeout=10)
