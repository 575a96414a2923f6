"""The `policy` label through the real server: requests count under their cache policy's form,
never its numbers, so the label stays bounded however many budgets clients ask for."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.cache_policy import FORM_SYNTAX, parse_cache_policy
from service.api import generation_pb2 as pb
from service.process import ServerProcess, wait_for

POLICY_SERIES = (
    "posenc_time_to_first_token_seconds_count",
    "posenc_inter_token_latency_seconds_count",
    "posenc_generated_tokens_total",
    "posenc_prompt_tokens_total",
    "posenc_kv_cache_used_bytes",
    "posenc_requests_shed_total",
)


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository, "--models", "alibi", "learned").wait_serving()
    yield process
    process.stop()


def policies_of(server: ServerProcess, name: str, model: str) -> set[str]:
    pattern = re.compile(rf'^{name}\{{[^}}]*model="{model}"[^}}]*policy="([^"]+)"', re.M)
    return set(pattern.findall(server.metrics()))


def test_form_drops_the_numbers() -> None:
    forms = {parse_cache_policy(text).form for text in ("", "full", "window:8", "window:300", "sinks:2+window:9",
             "int8", "window:5+int8", "sinks:1+window:7+int8")}  # fmt: skip
    assert forms == set(FORM_SYNTAX)


def test_every_policy_series_exists_per_accepted_form_before_any_request(server: ServerProcess) -> None:
    """Children are made up front for the forms a model accepts: alibi all six (it evicts and has
    an int8 graph), learned only what its manifest allows; ListModels shows the same forms."""
    listed = {m.name: list(m.cache_policies) for m in server.stub.ListModels(pb.ListModelsRequest()).models}
    for model in ("alibi", "learned"):
        expected = {form for form, syntax in FORM_SYNTAX.items() if syntax in listed[model]}
        assert "full" in expected
        for name in POLICY_SERIES:
            assert policies_of(server, name, model) == expected, (name, model)
    assert set(listed["alibi"]) == set(FORM_SYNTAX.values())


def test_tokens_and_latencies_count_under_their_form(server: ServerProcess) -> None:
    def generated(form: str) -> float:
        return server.metric("posenc_generated_tokens_total", model="alibi", policy=form)

    before = {form: generated(form) for form in FORM_SYNTAX}
    ttft_before = server.metric("posenc_time_to_first_token_seconds_count", model="alibi", policy="window")
    for policy in ("window:16", "window:40", "sinks:2+window:30", "window:16+int8", ""):
        request = pb.GenerateRequest(model="alibi", prompt="def f(x):\n", max_new_tokens=6, cache_policy=policy)
        assert server.stub.Generate(request, timeout=30).usage.completion_tokens == 6
    after = {form: generated(form) for form in FORM_SYNTAX}
    assert {form: after[form] - before[form] for form in FORM_SYNTAX} == {
        "full": 6, "window": 12, "sinks": 6, "int8": 0, "window+int8": 6, "sinks+int8": 0,
    }  # fmt: skip
    assert server.metric("posenc_time_to_first_token_seconds_count", model="alibi", policy="window") == ttft_before + 2
    assert policies_of(server, "posenc_generated_tokens_total", "alibi") == set(FORM_SYNTAX)  # nothing new


def test_kv_bytes_held_are_split_by_form_while_a_stream_runs(server: ServerProcess) -> None:
    """A window:32 stream's bytes show under policy="window" alone, bounded by its budget in whole
    blocks, and go back to zero when it ends."""
    request = pb.GenerateRequest(model="alibi", prompt="import os\n", max_new_tokens=1000, cache_policy="window:32")
    reader = threading.Thread(target=lambda: [None for _ in server.stub.GenerateStream(request, timeout=60)])
    reader.start()
    held: list[dict[str, float]] = []
    while reader.is_alive():
        held.append({f: server.metric("posenc_kv_cache_used_bytes", model="alibi", policy=f) for f in FORM_SYNTAX})
    reader.join()
    busy = [h for h in held if h["window"] > 0]
    assert busy and all(sum(v for f, v in h.items() if f != "window") == 0 for h in busy)
    (alibi,) = [m for m in server.stub.ListModels(pb.ListModelsRequest()).models if m.name == "alibi"]
    blocks = -(-33 // 16)  # the budget and the new token, in blocks of the default --block-size
    assert max(h["window"] for h in busy) <= blocks * 16 * alibi.kv_cache_bytes_per_token
    assert wait_for(lambda: server.metric("posenc_kv_cache_used_bytes", model="alibi") == 0)
