"""Access control with real certificates made in the test: TLS, mutual TLS, bearer tokens."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.process import ServerProcess

TOKEN = "s3cret-token"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=posenc test CA", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *ext, cwd=d)  # fmt: skip
    (d / "token").write_text(TOKEN + "\n")
    return d


def tls_credentials(pki: Path, client_cert: bool = False) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
    )


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_tls_with_bearer_token(repository: Path, pki: Path) -> None:
    flags = ["--models", "none", "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
             "--auth-token-file", str(pki / "token")]  # fmt: skip
    server = ServerProcess(repository, *flags, credentials=tls_credentials(pki)).wait_serving()
    try:
        request = pb.GenerateRequest(model="none", prompt="x", max_new_tokens=2)
        calls = {
            "ListModels": lambda md: server.stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=md),
            "Generate": lambda md: server.stub.Generate(request, timeout=10, metadata=md),
            "GenerateStream": lambda md: list(server.stub.GenerateStream(request, timeout=10, metadata=md)),
        }
        for call in calls.values():
            for metadata in (None, bearer("wrong"), [("authorization", TOKEN)]):
                with pytest.raises(grpc.RpcError) as error:
                    call(metadata)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Each refused call is counted once, as what its client saw.
        for method in calls:
            assert server.metric("posenc_requests_total", method=method, code="UNAUTHENTICATED") == 3
        # With the token every call is served in full.
        listed = calls["ListModels"](bearer(TOKEN))
        assert [m.name for m in listed.models] == ["none"]
        generated = calls["Generate"](bearer(TOKEN))
        assert generated.finish_reason == pb.FINISH_REASON_LENGTH
        assert generated.usage.completion_tokens == 2 and generated.usage.prompt_tokens == 2  # BOS and "x"
        assert generated.text
        chunks = calls["GenerateStream"](bearer(TOKEN))
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert chunks[-1].usage.completion_tokens == 2
        assert "".join(c.text for c in chunks) == generated.text  # greedy: the same text
        # Probes need no token.
        health = server.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # Plaintext clients cannot talk to a TLS port.
        with grpc.insecure_channel(server.target) as plain:
            with pytest.raises(grpc.RpcError) as error:
                stub = generation_pb2_grpc.GenerationStub(plain)
                stub.ListModels(pb.ListModelsRequest(), timeout=5, metadata=bearer(TOKEN))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_mutual_tls_requires_a_client_certificate(repository: Path, pki: Path) -> None:
    flags = ["--models", "none", "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
             "--tls-client-ca", str(pki / "ca.pem")]  # fmt: skip
    server = ServerProcess(repository, *flags, credentials=tls_credentials(pki, client_cert=True)).wait_serving()
    try:
        assert server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models[0].name == "none"
        with grpc.secure_channel(server.target, tls_credentials(pki, client_cert=False)) as anonymous:
            with pytest.raises(grpc.RpcError) as error:
                generation_pb2_grpc.GenerationStub(anonymous).ListModels(pb.ListModelsRequest(), timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_metrics_bind_to_their_own_address(repository: Path) -> None:
    server = ServerProcess(repository, "--models", "none", "--metrics-host", "127.0.0.2").wait_serving()
    try:
        with urllib.request.urlopen(f"http://127.0.0.2:{server.metrics_port}/metrics", timeout=5) as response:
            assert b"posenc_kv_cache_capacity_bytes" in response.read()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=2)
    finally:
        server.stop()
