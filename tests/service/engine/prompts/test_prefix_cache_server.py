"""The prefix cache through the real server on loopback: a hit changes no greedy token, for every
scheme and every policy that takes part, and says how many prompt tokens it reused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from models.checkpoints import trained_schemes
from service.api import generation_pb2 as pb
from service.process import ServerProcess

TRAINED = trained_schemes()  # the schemes with shipped weights: what the repository fixture exports

# 96 bytes shared (with BOS, 6 whole blocks of 16 and one token), then tails that differ; learned's 256 positions fit.
PREFIX = "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as handle:\n        text = hand"
TAILS = ["le.read()\n    return ", "le.readlines()\n    for line in ", "le.read().split()\n    if not "]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def servers(repository: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    cached = ServerProcess(repository)
    uncached = ServerProcess(repository, "--no-prefix-cache")
    try:
        yield cached.wait_serving(), uncached.wait_serving()
    finally:
        cached.stop()
        uncached.stop()


def generate(server: ServerProcess, model: str, prompt: str, policy: str = "") -> pb.GenerateResponse:
    request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=NEW_TOKENS, cache_policy=policy)
    return server.stub.Generate(request, timeout=120)


@pytest.mark.parametrize("scheme", TRAINED)
def test_a_hit_gives_the_same_greedy_tokens_as_no_cache(
    servers: tuple[ServerProcess, ServerProcess], scheme: str
) -> None:
    cached, uncached = servers
    first = generate(cached, scheme, PREFIX + TAILS[0])
    assert first.usage.cached_prompt_tokens == 0  # nothing cached yet
    assert first.text == generate(uncached, scheme, PREFIX + TAILS[0]).text
    for tail in TAILS[1:]:
        hit = generate(cached, scheme, PREFIX + tail)
        assert hit.usage.cached_prompt_tokens == 96  # the 6 whole blocks of the shared prefix
        assert hit.usage.prompt_tokens == len(PREFIX + tail) + 1
        assert hit.text == generate(uncached, scheme, PREFIX + tail).text
    again = generate(cached, scheme, PREFIX + TAILS[0])  # the whole prompt cached: its last token is computed
    assert again.usage.cached_prompt_tokens == (len(PREFIX + TAILS[0]) + 1) // 16 * 16
    assert again.text == first.text
    assert generate(uncached, scheme, PREFIX + TAILS[1]).usage.cached_prompt_tokens == 0  # --no-prefix-cache


@pytest.mark.parametrize("policy", ["int8", "window:200", "sinks:4+window:150+int8"])
def test_policies_whose_prompt_fits_before_eviction_reuse_exactly(
    servers: tuple[ServerProcess, ServerProcess], policy: str
) -> None:
    cached, uncached = servers
    for scheme in ("rope", "alibi"):
        generate(cached, scheme, PREFIX + TAILS[0], policy)
        hit = generate(cached, scheme, PREFIX + TAILS[1], policy)
        assert hit.usage.cached_prompt_tokens == 96, (scheme, policy)
        assert hit.text == generate(uncached, scheme, PREFIX + TAILS[1], policy).text, (scheme, policy)


def test_a_prompt_longer_than_a_bounded_policy_is_not_cached(servers: tuple[ServerProcess, ServerProcess]) -> None:
    cached, uncached = servers
    prompt = PREFIX * 3
    generate(cached, "alibi", prompt, "window:64")
    hit = generate(cached, "alibi", prompt, "window:64")
    assert hit.usage.cached_prompt_tokens == 0
    assert hit.text == generate(uncached, "alibi", prompt, "window:64").text


def test_metrics_count_queried_and_hit_tokens_and_cached_bytes(servers: tuple[ServerProcess, ServerProcess]) -> None:
    cached, _ = servers
    names = ["posenc_prefix_cache_queried_tokens_total", "posenc_prefix_cache_hit_tokens_total"]
    before = cached.sample(names, model="none")
    generate(cached, "none", "# metrics\n" + PREFIX)
    generate(cached, "none", "# metrics\n" + PREFIX + "x")
    after = cached.sample([*names, "posenc_prefix_cache_bytes", "posenc_kv_cache_physical_bytes"], model="none")
    queried = after[names[0]] - before[names[0]]
    assert queried == 2 * len("# metrics\n" + PREFIX) + 1 + 2
    assert after[names[1]] - before[names[1]] == 96
    assert 0 < after["posenc_prefix_cache_bytes"] <= after["posenc_kv_cache_physical_bytes"]
