"""The light lane under fair scheduling: a tenant's short prompt, while the prefill worker holds only
other tenants' prompts, goes to the tail worker (its own thread at the decode thread's priority), and
comes back as the same prompt the worker would have computed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from contract.manifest import Manifest
from models.tokenizer import TOKENIZER
from service.engine.kv.rows import SplitKV
from service.engine.messages import EngineConfig
from service.engine.prompts.dispatch import PromptDispatch
from service.engine.prompts.prefill import PrefillResult
from service.engine.request import Request, SamplingParams
from service.engine.worker.runner import ModelRunner, StoreConfig
from service.metrics import ServiceMetrics
from tests.service.engine.prompt_calls import batch
from tests.service.engine.prompts.test_prefill_worker import Collector, job

SHORT = "def f(x):\n    return x\n"


def request(name: str, tenant: str, text: str = SHORT) -> Request:
    made = Request(name, "alibi", TOKENIZER.encode(text), SamplingParams(max_new_tokens=1), eos_token_id=257)
    made.tenant = tenant
    return made


def dispatch(repository: Path, **config: object) -> PromptDispatch:
    """A dispatch whose workers are not started: what it submits stays where it was sent."""
    manifest = Manifest.load(repository / "alibi")
    runner = ModelRunner(manifest, StoreConfig(64 << 20, 16, 1024), "cpu", threads=1)
    settings = EngineConfig(**{"prefix_cache": False, "tenants": 3, **config})  # type: ignore[arg-type]
    return PromptDispatch(manifest, settings, runner, ServiceMetrics(CollectorRegistry()),
                          lambda results: None, lambda *figures: None, lambda: False)  # fmt: skip


def test_a_quiet_tenant_s_short_prompt_beside_a_noisy_backlog_takes_the_light_lane(repository: Path) -> None:
    prompts = dispatch(repository)
    prompts.submit([request("noisy-1", "noisy"), request("noisy-2", "noisy")])
    assert not prompts.tail_worker.holds()  # nobody else's prompt was in the worker: the noisy ones queue
    prompts.submit([request("quiet-1", "quiet"), request("quiet-2", "quiet")])
    assert prompts.tail_worker.holds("quiet") and prompts.prefill_worker.holds("quiet")  # one each
    prompts.submit([request("quiet-3", "quiet"), request("long", "other", SHORT * 40)])
    assert [j.request.request_id for j in prompts.tail_worker._jobs] == ["quiet-1"]  # quiet holds one; long: long


@pytest.mark.parametrize("config", [{"scheduling": "fcfs"}, {"light_prefill_tokens": 0}, {"tenants": 1}])
def test_without_fair_scheduling_or_with_the_lane_off_every_prompt_goes_to_the_worker(
    repository: Path, config: dict[str, object]
) -> None:
    prompts = dispatch(repository, **config)
    prompts.submit([request("noisy-1", "noisy")])
    prompts.submit([request("quiet-1", "quiet")])
    assert not prompts.tail_worker.holds() and prompts.prefill_worker.holds("quiet")


SCHEMES = ("alibi", "learned", "mla", "none", "relative", "rnope-swa", "rope", "rope-swa", "sinusoidal")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_light_prompt_comes_back_as_the_worker_computes_it(repository: Path, scheme: str) -> None:
    """Whole, with no past, on the tail lane (where the scheme has one): the worker's logits and cache;
    each worker holds the tenant until it hands the prompt back."""
    manifest = Manifest.load(repository / scheme)
    runner = ModelRunner(manifest, StoreConfig(64 << 20, 16, 1024), "cpu", threads=1)
    collector = Collector()
    config = EngineConfig(prefix_cache=False, tenants=2)
    prompts = PromptDispatch(manifest, config, runner, ServiceMetrics(CollectorRegistry()),
                             collector.deliver, collector.observe, lambda: False)  # fmt: skip
    if not prompts._light_tokens:
        assert runner.prompt_variant is None  # no fused prompt graph: no tail lane, so no light one
        return
    prompts.start()
    try:
        prompts.prefill_worker.submit([job("worker", SHORT)])
        collector.wait_for(1)
        assert not prompts.prefill_worker.holds()
        prompts.tail_worker.submit([job("lane", SHORT)])
        collector.wait_for(2)
    finally:
        prompts.stop()
    assert not prompts.tail_worker.holds()
    expected = batch(runner, {"alone": TOKENIZER.encode(SHORT)})[0]
    for result in collector.results:
        assert result.prompt is not None, result.error
        np.testing.assert_allclose(result.prompt.logits, expected.logits, atol=1e-4)
        for made, wanted in zip(arrays(result.prompt.cache), arrays(expected.cache), strict=True):
            np.testing.assert_allclose(made, wanted, atol=1e-5)


def arrays(cache: object) -> list[object]:
    """A row's cache as arrays (a hybrid's SplitKV: its global and its local part)."""
    return [cache.global_kv, cache.local_kv] if isinstance(cache, SplitKV) else [cache]


def test_a_result_without_a_prompt_still_releases_its_tenant(repository: Path) -> None:
    prompts = dispatch(repository)
    gone = job("gone", SHORT)
    prompts.prefill_worker.submit([gone])
    assert prompts.prefill_worker.holds("")
    prompts.prefill_worker._deliver([PrefillResult(gone)])
    assert not prompts.prefill_worker.holds()
