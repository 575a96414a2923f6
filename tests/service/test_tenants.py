"""Tenants and cache salts through a real server on loopback: a salt, or another tenant's token,
never reads the prefix cache of another, and the same tenant still hits (vLLM's CVE-2025-46570)."""

from __future__ import annotations

import threading
import time
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


# ---------------------------------------------------------------------------------- fair share and limits

LIMITED = {"acme": "acme-secret", "globex": "globex-secret", "initech": "initech-secret", "hooli": "hooli-secret"}


@pytest.fixture(scope="module")
def limited(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """acme may run one request at a time, globex 300 tokens a minute, initech and hooli have no limit;
    two rows."""
    path = tmp_path_factory.mktemp("limits") / "tokens"
    path.write_text(
        "acme:acme-secret max_concurrent=1\nglobex:globex-secret:2 tokens_per_minute=300\n"
        "initech:initech-secret\nhooli:hooli-secret\n"
    )
    flags = ("--models", "alibi", "--auth-tokens-file", str(path), "--max-batch-size", "2", "--no-prefix-cache")
    process = ServerProcess(repository, *flags).wait_serving()
    yield process
    process.stop()


def long_stream(server: ServerProcess, tenant: str, tokens: int = 1000) -> Iterator[pb.GenerateStreamResponse]:
    request = pb.GenerateRequest(model="alibi", prompt="tell me", max_new_tokens=tokens, ignore_eos=True)
    metadata = [("authorization", f"Bearer {LIMITED[tenant]}")]
    return server.stub.GenerateStream(request, timeout=120, metadata=metadata)


def complete(server: ServerProcess, tenant: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": "alibi", "prompt": "hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {LIMITED[tenant]}"}
    return httpx.post(server.http_url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_a_tenant_past_its_concurrency_gets_429_naming_it_and_others_are_served(limited: ServerProcess) -> None:
    stream = long_stream(limited, "acme")
    next(stream)  # running
    try:
        refused = complete(limited, "acme")
        assert refused.status_code == 429, refused.text
        assert "max_concurrent" in refused.json()["error"]["message"] and int(refused.headers["Retry-After"]) >= 1
        with pytest.raises(grpc.RpcError) as error:
            next(long_stream(limited, "acme"))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in error.value.details()
        assert dict(error.value.trailing_metadata())["retry-after-ms"]
        assert complete(limited, "initech").status_code == 200  # another tenant: unaffected
    finally:
        stream.cancel()
    assert limited.metric("posenc_tenant_refusals_total", tenant="acme", reason="max_concurrent") == 2
    assert limited.metric("posenc_tenant_requests_total", tenant="initech") >= 1


def test_a_tenant_past_its_tokens_a_minute_gets_429_naming_it(limited: ServerProcess) -> None:
    assert complete(limited, "globex", 200).status_code == 200  # charged its prompt and 200 new tokens
    refused = complete(limited, "globex", 200)
    assert refused.status_code == 429 and "tokens_per_minute" in refused.json()["error"]["message"], refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    assert complete(limited, "initech", 200).status_code == 200


def test_a_quiet_tenant_s_one_request_goes_before_a_noisy_tenant_s_queue(limited: ServerProcess) -> None:
    """Two rows, six long streams of one tenant, then one request of another: it is admitted at once
    (it takes a row from the noisy tenant), not after the four waiting streams."""
    finished: list[str] = []
    lock = threading.Lock()

    def run(tenant: str, tokens: int) -> None:
        for _ in long_stream(limited, tenant, tokens):
            pass
        with lock:
            finished.append(tenant)

    noisy = [threading.Thread(target=run, args=("initech", 1000)) for _ in range(6)]  # about 1 s each
    for thread in noisy:
        thread.start()
    time.sleep(0.3)  # two run, four wait
    quiet = threading.Thread(target=run, args=("hooli", 8))
    quiet.start()
    for thread in [*noisy, quiet]:
        thread.join(120)
    assert finished.index("hooli") <= 2, finished  # first come, first served: after 4 or more noisy ones
