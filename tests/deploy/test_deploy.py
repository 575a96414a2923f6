"""Deployment files: compose and Prometheus configs validate, and every dashboard query returns
data from a real Prometheus scraping the real service on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from service.api import generation_pb2 as pb
from service.process import ROOT, ServerProcess, free_port

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "posenc-serve.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
Tool = Callable[[str], str]


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_compose_file_validates_and_every_path_exists(tool: Tool) -> None:
    subprocess.run([tool("docker-compose"), "config", "-q"], cwd=ROOT, check=True)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            context = ROOT / build["context"]
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
            target = build.get("target")
            assert re.search(rf"^FROM .* AS {target}$", (context / "Dockerfile").read_text(), re.M), (name, target)
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), (name, source)
    assert compose["services"]["server"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_compose_puts_every_replica_behind_the_proxy() -> None:
    """`--scale server=N` works: replicas publish no host port (N containers cannot share one),
    answer as `server`, and the proxy, the only published gRPC port, runs the shipped nginx.conf."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("server", "server-cpu"):
        assert "ports" not in services[name], name
        assert services[name]["networks"]["default"]["aliases"] == ["server"], name
    proxy = services["proxy"]
    assert proxy["image"].startswith("nginx:") and "profiles" not in proxy
    assert proxy["ports"] == ["${POSENC_GRPC_PORT:-50051}:50051"]
    assert "./deploy/nginx/nginx.conf:/etc/nginx/nginx.conf:ro" in proxy["volumes"]
    assert "./deploy/nginx/upstream.compose.conf:/etc/nginx/upstream.conf:ro" in proxy["volumes"]
    assert "--host proxy:50051" in services["locust-master"]["command"]


def test_prometheus_config_passes_promtool_and_discovers_every_replica(tool: Tool) -> None:
    subprocess.run([tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)], check=True)
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    assert job["dns_sd_configs"] == [{"names": ["server"], "type": "A", "port": 9464, "refresh_interval": "5s"}]


def test_dashboard_only_queries_metrics_the_service_defines() -> None:
    defined = (ROOT / "service" / "metrics.py").read_text()
    for expr in dashboard_queries():
        for metric in re.findall(r"posenc_[a-z_]+", expr):
            base = re.sub(r"_(bucket|sum|count|total)$", "", metric)
            assert f'"{base}"' in defined, metric


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


def test_every_dashboard_query_returns_data_from_real_prometheus(
    server: ServerProcess, tmp_path: Path, tool: Tool
) -> None:
    prometheus = tool("prometheus")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = "1s"
    (job,) = config["scrape_configs"]  # the shipped job, its DNS discovery swapped for the loopback replica
    del job["dns_sd_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{server.metrics_port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for i in range(8):  # traffic across several scrapes, so rates have two points
            for model in ("alibi", "rope"):
                request = pb.GenerateRequest(model=model, prompt=f"def f{i}():\n", max_new_tokens=8)
                server.stub.Generate(request, timeout=30)
            time.sleep(0.5)

        def query(expr: str) -> list[object]:
            url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            with urllib.request.urlopen(url, timeout=5) as response:
                body = json.loads(response.read())
            assert body["status"] == "success", (expr, body)
            return body["data"]["result"]

        deadline = time.monotonic() + 60
        missing = dashboard_queries()
        while missing and time.monotonic() < deadline:
            missing = [expr for expr in missing if not query(expr)]
            time.sleep(1)
        assert not missing, f"queries without data: {missing}"
    finally:
        process.terminate()
        process.wait(timeout=10)
