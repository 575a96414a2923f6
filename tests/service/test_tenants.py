"""Tenants and cache salts through a real server on loopback: a salt, or another tenant's token,
never reads the prefix cache of another, and the same tenant still hits (vLLM's CVE-2025-46570)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from service.api import generation_pb2 as pb
from service.process import ServerProcess
from service.security import Tenants, cache_salt

TOKENS = {"acme": "acme-secret", "globex": "globex-secret"}
# About 2 KB of code, different for each test so that no test reads another's cached blocks.
BODY = "".join(f"def handler_{i}(request):\n    return respond(request, status={200 + i})\n\n" for i in range(36))


def test_tenants_read_the_token_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# tenants\nacme: acme-secret\n\nglobex:globex:secret  # a token may hold a colon\n")
    tenants = Tenants.read("admin", path)
    assert tenants.tenant("Bearer acme-secret") == "acme"
    assert tenants.tenant("Bearer globex:secret") == "globex"
    assert tenants.tenant("Bearer admin") == ""  # the single --auth-token: the unsalted tenant
    assert tenants.tenant("Bearer nobody") is None and tenants.tenant("") is None
    assert Tenants().tenant("") == "" and not Tenants().required
    for bad in ("acme:x\nacme:y\n", "no token here\n", "bad name!:x\n"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="tokens"):
            Tenants.read(None, path)
    with pytest.raises(ValueError, match="share a token"):
        Tenants({"a": "same", "b": "same"})


def test_a_client_salt_is_combined_with_the_tenant_never_replacing_it() -> None:
    assert cache_salt("", "") == ""
    salts = {cache_salt(t, c) for t in ("", "acme", "globex") for c in ("", "x", "acme")}
    assert len(salts) == 9  # no two (tenant, client salt) pairs share a salt
    assert cache_salt("acme", "x") != cache_salt("globex", "x")


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("tenants") / "tokens"
    path.write_text("".join(f"{tenant}:{token}\n" for tenant, token in TOKENS.items()))
    process = ServerProcess(repository, "--models", "alibi", "--auth-tokens-file", str(path)).wait_serving()
    yield process
    process.stop()


def cached_http(server: ServerProcess, tenant: str, prompt: str, salt: str | None = None) -> int:
    body: dict[str, object] = {"model": "alibi", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {TOKENS[tenant]}"}
    response = httpx.post(server.http_url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def cached_grpc(server: ServerProcess, tenant: str, prompt: str, salt: str = "") -> int:
    request = pb.GenerateRequest(model="alibi", prompt=prompt, max_new_tokens=1, cache_salt=salt)
    metadata = [("authorization", f"Bearer {TOKENS[tenant]}")]
    return server.stub.Generate(request, timeout=60, metadata=metadata).usage.cached_prompt_tokens


def test_cache_salt_a_a_b_gives_0_then_a_hit_then_0(server: ServerProcess) -> None:
    prompt = "# salted over HTTP\n" + BODY
    assert len(prompt) >= 2000
    hits = [cached_http(server, "acme", prompt, salt) for salt in ("a", "a", "b")]
    assert hits[0] == 0 and hits[1] > 1900 and hits[2] == 0, hits
    prompt = "# salted over gRPC\n" + BODY
    hits = [cached_grpc(server, "acme", prompt, salt) for salt in ("a", "a", "b")]
    assert hits[0] == 0 and hits[1] > 1900 and hits[2] == 0, hits


def test_another_tenant_misses_and_the_same_tenant_hits(server: ServerProcess) -> None:
    for cached, api in ((cached_http, "HTTP"), (cached_grpc, "gRPC")):
        prompt = f"# {api}: tenants\n" + BODY
        assert cached(server, "acme", prompt) == 0
        assert cached(server, "acme", prompt) > 1900  # the same tenant still hits
        assert cached(server, "globex", prompt) == 0  # another tenant's identical prompt: a miss
        assert cached(server, "globex", prompt) > 1900
    # A client salt is combined with its tenant's: copying acme's salt gives globex nothing of acme's.
    prompt = "# a copied salt\n" + BODY
    assert cached_http(server, "acme", prompt, "shared") == 0
    assert cached_http(server, "globex", prompt, "shared") == 0
    assert cached_http(server, "acme", prompt, "shared") > 1900


def test_each_tenants_token_is_needed(server: ServerProcess) -> None:
    response = httpx.post(server.http_url + "/v1/completions", json={"model": "alibi", "prompt": "x"},
                          headers={"Authorization": "Bearer wrong"}, timeout=30)  # fmt: skip
    assert response.status_code == 401
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="x"), timeout=30)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
