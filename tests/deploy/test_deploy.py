"""Deployment files: compose and Prometheus configs validate, and the service's metrics pass
promtool (the Grafana dashboard's queries run against a real Prometheus in test_dashboard.py)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from contract.paths import REPOSITORY_ROOT
from service.api import generation_pb2 as pb
from service.process import ServerProcess

PROMETHEUS_CONFIG = REPOSITORY_ROOT / "deploy" / "prometheus" / "prometheus.yml"
Tool = Callable[[str], str]


def test_compose_file_validates_and_every_path_exists(tool: Tool) -> None:
    subprocess.run([tool("docker-compose"), "config", "-q"], cwd=REPOSITORY_ROOT, check=True)
    compose = yaml.safe_load((REPOSITORY_ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            context = REPOSITORY_ROOT / build["context"]
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
            target = build.get("target")
            assert re.search(rf"^FROM .* AS {target}$", (context / "Dockerfile").read_text(), re.M), (name, target)
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPOSITORY_ROOT / source).exists(), (name, source)
    assert compose["services"]["server"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_compose_runs_the_shipped_haproxy_cfg_for_prefix_affinity() -> None:
    affinity = yaml.safe_load((REPOSITORY_ROOT / "docker-compose.yml").read_text())["services"]["affinity-proxy"]
    assert "./deploy/haproxy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in affinity["volumes"]
    assert affinity["environment"]["POSENC_REPLICAS"] == "server"  # every replica's alias
    assert affinity["environment"]["POSENC_BALANCE"] == "${POSENC_BALANCE:-hdr(x-routing-key)}"
    assert [port.rpartition(":")[2] for port in affinity["ports"]] == ["50051", "8000"]


def test_compose_puts_every_replica_behind_the_proxy() -> None:
    """`--scale server=N` works: replicas publish no host port (N containers cannot share one),
    answer as `server`, and the proxy, the only published gRPC port, runs the shipped nginx.conf."""
    services = yaml.safe_load((REPOSITORY_ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("server", "server-cpu"):
        assert "ports" not in services[name], name
        assert services[name]["networks"]["default"]["aliases"] == ["server"], name
    proxy = services["proxy"]
    assert proxy["image"].startswith("nginx:") and "profiles" not in proxy
    # gRPC and the OpenAI-compatible HTTP API, each on the port the shipped nginx.conf listens on.
    assert proxy["ports"] == ["${POSENC_GRPC_PORT:-50051}:50051", "${POSENC_HTTP_PORT:-8000}:8000"]
    listens = re.findall(r"^\s*listen (\d+)", (REPOSITORY_ROOT / "deploy" / "nginx" / "nginx.conf").read_text(), re.M)
    assert listens == ["50051", "8000"]
    for name in ("server", "server-cpu"):  # the replicas serve HTTP where the proxy's upstream looks for it
        assert services[name]["environment"]["POSENC_HTTP_PORT"] == "8000" and "8000" in services[name]["expose"]
    upstream = (REPOSITORY_ROOT / "deploy" / "nginx" / "upstream.compose.conf").read_text()
    assert re.findall(r"server server:(\d+) resolve", upstream) == ["50051", "8000"]
    assert "./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro" in proxy["volumes"]
    assert "./deploy/nginx/upstream.compose.conf:/etc/nginx/upstream.conf:ro" in proxy["volumes"]
    assert "--host proxy:50051" in services["locust-master"]["command"]
    assert services["locust-master"]["environment"]["LOCUST_API"] == "${LOCUST_API:-grpc}"


def test_prometheus_config_passes_promtool_and_discovers_every_replica(tool: Tool) -> None:
    subprocess.run([tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)], check=True)
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    assert job["dns_sd_configs"] == [{"names": ["server"], "type": "A", "port": 9464, "refresh_interval": "5s"}]


@pytest.fixture(scope="module")
def server(repository: Path):  # type: ignore[no-untyped-def]
    process = ServerProcess(repository, "--models", "alibi", "rope").wait_serving()
    yield process
    process.stop()


def test_promtool_check_metrics_finds_no_problems(server: ServerProcess, tool: Tool) -> None:
    server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="x = ", max_new_tokens=4), timeout=30)
    command = [tool("promtool"), "check", "metrics"]
    result = subprocess.run(command, input=server.metrics(), capture_output=True, text=True)
    problems = result.stdout.strip() + result.stderr.strip()
    assert result.returncode == 0 and not problems, problems
