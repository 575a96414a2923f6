"""Per-tenant terms and limits: the token file's weights and limits, and the quota's refusals and
retry hints on a hand-moved clock (pure logic; through a real server in test_tenants.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from service.engine.messages import ErrorKind, RequestError
from service.metrics import TENANT, ServiceMetrics
from service.quota import WINDOW_SECONDS, TenantQuota
from service.security import Tenants, TenantTerms


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_token_file_line_may_add_a_weight_and_limits(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(
        "noisy:n-secret\nquiet:q:secret:4 max_concurrent=2 tokens_per_minute=900\n"
        "plain: p-secret  tokens_per_minute=5\n"
    )
    tenants = Tenants.read(None, path)
    assert tenants.tenant("Bearer q:secret") == "quiet" and tenants.tenant("Bearer p-secret") == "plain"
    assert tenants.terms["quiet"] == TenantTerms(4.0, 2, 900)
    assert tenants.terms["noisy"] == TenantTerms() and tenants.terms["plain"] == TenantTerms(tokens_per_minute=5)
    assert tenants.weights() == {"quiet": 4.0} and tenants.names == ["noisy", "quiet", "plain"]
    for bad, field in (("a:x:0\n", "weight"), ("a:x max_concurrent=0\n", "max_concurrent"), ("a:x:2000\n", "weight")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=field):
            Tenants.read(None, path)
    assert Tenants().names == [""]  # no tokens: one anonymous tenant


def quota(clock: Clock, metrics: ServiceMetrics | None = None) -> TenantQuota:
    terms = {"a": TenantTerms(max_concurrent=2, tokens_per_minute=1000), "b": TenantTerms()}
    return TenantQuota(terms, TenantTerms(max_concurrent=5), metrics, clock)


def test_concurrency_past_the_limit_is_refused_naming_it_and_others_are_unaffected() -> None:
    clock, registry = Clock(), CollectorRegistry()
    limits = quota(clock, ServiceMetrics(registry, TENANT))
    first, _ = limits.acquire("a", 10), limits.acquire("a", 10)
    with pytest.raises(RequestError, match=r"max_concurrent: tenant 'a'.*max_concurrent is 2") as refused:
        limits.acquire("a", 10)
    assert refused.value.kind is ErrorKind.RESOURCE_EXHAUSTED and refused.value.retry_after
    assert [limits.acquire("b", 10) for _ in range(5)]  # b's own default limit: 5
    limits.release(first, 10, 0, 0.01)
    limits.acquire("a", 10)  # a place came back
    unserved = {"model": "", "scheme": ""}
    value = registry.get_sample_value
    assert value("posenc_tenant_refusals_total", {**unserved, "tenant": "a", "reason": "max_concurrent"}) == 1
    assert value("posenc_tenant_requests_total", {**unserved, "tenant": "b"}) == 5
    assert value("posenc_tenant_tokens_total", {**unserved, "tenant": "a", "kind": "prompt"}) == 10


def test_tokens_a_minute_are_charged_then_corrected_and_the_hint_says_when_they_fit() -> None:
    clock = Clock()
    limits = quota(clock)
    big = limits.acquire("a", 600)
    clock.now += 10
    with pytest.raises(RequestError, match=r"tokens_per_minute: tenant 'a'.*600 tokens in the last minute") as refused:
        limits.acquire("a", 500)
    assert refused.value.retry_after == pytest.approx(WINDOW_SECONDS - 10, abs=0.2)
    limits.release(big, 100, 50, None)  # it used 150 of the 600 it was charged
    limits.release(limits.acquire("a", 500), 500, 0, None)
    with pytest.raises(RequestError, match="never fits"):
        limits.acquire("a", 5000)
    clock.now += WINDOW_SECONDS
    limits.acquire("a", 900)
