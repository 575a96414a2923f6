"""Kubernetes manifests (deploy/k8s/): every one validates offline against the schemas of current
Kubernetes versions (kubernetes-validate, strict: unknown fields fail), and they fit together:
gRPC probes, the GPU request, the proxy's nginx.conf being the shipped one, selectors that
select, the HTTP API's port from the replicas through the proxy, autoscaling on metrics the service
defines."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from contract.paths import REPOSITORY_ROOT

K8S = REPOSITORY_ROOT / "deploy" / "k8s"
NGINX_DIR = REPOSITORY_ROOT / "deploy" / "nginx"
# The oldest Kubernetes release the manifests promise (maintained upstream when this was written)
# and the newest one the pinned kubernetes-validate ships schemas for.
VERSIONS = ("1.31.0", "1.37.0")
SERVER_LABELS = {"app.kubernetes.io/name": "posenc-serve", "app.kubernetes.io/component": "server"}


def manifests(*folders: str) -> list[dict[str, Any]]:
    folders = folders or ("common", "cpu", "gpu")
    files = sorted(path for folder in folders for path in (K8S / folder).glob("*.yaml"))
    return [doc for path in files for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(kind: str, name: str, folder: str = "common") -> dict[str, Any]:
    (found,) = [m for m in manifests(folder) if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def test_every_manifest_file_is_in_a_known_folder() -> None:
    assert {path.parent.name for path in K8S.rglob("*.yaml")} == {"common", "cpu", "gpu"}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version: str) -> None:
    for manifest in manifests():
        kubernetes_validate.validate(manifest, version, strict=True)
        assert manifest["metadata"].get("namespace", "posenc") == "posenc", manifest["metadata"]


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_server_deployment_probes_health_over_grpc_and_carries_its_models(variant: str) -> None:
    deployment = one("Deployment", "posenc-serve", variant)
    assert deployment["spec"]["selector"]["matchLabels"] == SERVER_LABELS
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"] == SERVER_LABELS
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "9464", "prometheus.io/path": "/metrics",
    }  # fmt: skip
    (container,) = pod["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 50051}, probe  # health service "" (the whole server)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": 50051, "http": 8000, "metrics": 9464}
    assert {"name": "POSENC_HTTP_PORT", "value": str(ports["http"])} in container["env"]
    assert container["image"] == f"posenc-serve:{variant}"
    # The image carries the model repository (exported at build time); nothing is mounted.
    dockerfile = (REPOSITORY_ROOT / "Dockerfile").read_text()
    assert "python -m export --out /models" in dockerfile and "POSENC_MODEL_REPOSITORY=/models" in dockerfile
    assert "volumeMounts" not in container
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    assert ("nvidia.com/gpu" in resources["limits"]) == (variant == "gpu")
    if variant == "gpu":
        assert resources["limits"]["nvidia.com/gpu"] == 1
    # SIGKILL only after the preStop pause and the server's own drain.
    env = {item["name"]: item.get("value") for item in container["env"]}
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = sum(float(env[name]) for name in ("POSENC_DRAIN_DELAY_SECONDS", "POSENC_GRACE_SECONDS",
                                              "POSENC_FINAL_SCRAPE_SECONDS"))  # fmt: skip
    assert pod["spec"]["terminationGracePeriodSeconds"] > pause + drain
    # NOT_SERVING is served at least one readiness period before the port closes.
    readiness = container["readinessProbe"]
    assert float(env["POSENC_DRAIN_DELAY_SECONDS"]) >= readiness["periodSeconds"] * readiness["failureThreshold"]


def test_cpu_and_gpu_deployments_differ_only_where_they_must() -> None:
    cpu, gpu = one("Deployment", "posenc-serve", "cpu"), one("Deployment", "posenc-serve", "gpu")
    cpu_pod, gpu_pod = cpu["spec"]["template"]["spec"], gpu["spec"]["template"]["spec"]
    (cpu_container,), (gpu_container,) = cpu_pod["containers"], gpu_pod["containers"]
    for key in set(cpu_container) - {"image", "resources"}:
        assert cpu_container[key] == gpu_container[key], key
    assert {k: v for k, v in cpu_pod.items() if k != "containers"} == {
        k: v for k, v in gpu_pod.items() if k not in ("containers", "tolerations")
    }


def test_services_select_the_pods_and_speak_http2() -> None:
    replicas = one("Service", "posenc-serve-replicas")
    assert replicas["spec"]["clusterIP"] == "None"  # headless: one address per ready replica
    assert replicas["spec"]["selector"] == SERVER_LABELS
    proxy_service, proxy = one("Service", "posenc-serve"), one("Deployment", "posenc-proxy")
    assert proxy_service["spec"]["selector"] == proxy["spec"]["template"]["metadata"]["labels"]
    for service in (replicas, proxy_service):
        grpc_port = next(port for port in service["spec"]["ports"] if port["name"] == "grpc")
        assert grpc_port["port"] == 50051 and grpc_port["appProtocol"] == "kubernetes.io/h2c"
        http_port = next(port for port in service["spec"]["ports"] if port["name"] == "http")
        assert http_port == {"name": "http", "port": 8000, "targetPort": "http", "appProtocol": "http"}
    (nginx,) = proxy["spec"]["template"]["spec"]["containers"]
    assert {port["name"]: port["containerPort"] for port in nginx["ports"]} == {"grpc": 50051, "http": 8000}
    budget = one("PodDisruptionBudget", "posenc-serve")
    assert budget["spec"]["selector"]["matchLabels"] == SERVER_LABELS


def test_the_proxy_runs_the_shipped_nginx_conf_over_the_headless_service() -> None:
    data = one("ConfigMap", "posenc-proxy")["data"]
    assert data["nginx.conf"] == (NGINX_DIR / "nginx.conf").read_text()

    # The same upstream as compose's, only the resolver and the name differ.
    def parameters(text: str) -> list[str]:
        lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        return [re.sub(r"^(resolver|server) \S+", r"\1 NAME", line) for line in lines]

    assert parameters(data["upstream.conf"]) == parameters((NGINX_DIR / "upstream.compose.conf").read_text())
    name = f"{one('Service', 'posenc-serve-replicas')['metadata']['name']}.posenc.svc.cluster.local"
    assert f"server {name}:50051 resolve" in data["upstream.conf"]
    assert f"server {name}:8000 resolve" in data["upstream.conf"]
    (container,) = one("Deployment", "posenc-proxy")["spec"]["template"]["spec"]["containers"]
    assert container["args"][:3] == ["nginx", "-c", "/etc/nginx/posenc/nginx.conf"]
    assert container["volumeMounts"][0]["mountPath"] == "/etc/nginx/posenc"


def test_the_affinity_proxy_runs_the_shipped_haproxy_cfg_over_the_headless_service() -> None:
    data = one("ConfigMap", "posenc-affinity-proxy")["data"]
    assert data["haproxy.cfg"] == (REPOSITORY_ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    deployment, service = one("Deployment", "posenc-affinity-proxy"), one("Service", "posenc-serve-affinity")
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    environment = {variable["name"]: variable["value"] for variable in container["env"]}
    replicas = one("Service", "posenc-serve-replicas")["metadata"]["name"]
    assert environment == {"POSENC_BALANCE": "hdr(x-routing-key)",
                           "POSENC_REPLICAS": f"{replicas}.posenc.svc.cluster.local"}  # fmt: skip
    assert container["args"][-1] == container["volumeMounts"][0]["mountPath"] + "/haproxy.cfg"
    assert {port["name"]: port["containerPort"] for port in container["ports"]} == {"grpc": 50051, "http": 8000}


def test_the_autoscaler_targets_the_deployment_on_gauges_the_service_exports() -> None:
    autoscaler = one("HorizontalPodAutoscaler", "posenc-serve")
    assert autoscaler["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "posenc-serve",
    }
    defined = (REPOSITORY_ROOT / "service" / "metrics.py").read_text()
    names = [metric["pods"]["metric"]["name"] for metric in autoscaler["spec"]["metrics"]]
    assert names == ["posenc_queued_sequences", "posenc_running_sequences"]
    for name in names:
        assert f'"{name}"' in defined, name
