"""The engine's side of the prefix cache (service.engine.kv.prefix): which prompts look it up, what
they take into their prefill, what they leave behind, and what /metrics says of it.

A prompt is looked up when its prefill is submitted and its full blocks are kept when its cache is
written into its row (the same step's join). Under a bounded cache policy (window, sinks) only a
prompt that fits the policy's budget takes part: its cache is then exactly the prompt's prefill,
as under `full`; a longer one streams through evictions, which a cached prefix cannot replay.
The key's extra part is the model, the policy's form and the request's cache salt, so int8 and float
rows never share, nor do two tenants (service.security): the salt enters the first block's key, and
with it every key of the chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.engine.kv import KVStore
from service.engine.kv.prefix import CachedPast, block_hashes
from service.engine.prompts.prompt import PrefilledPrompt
from service.engine.request import Request
from service.metrics import ServiceMetrics


@dataclass
class PrefixMetrics:
    queried: Any  # Counter children of one model
    hit: Any
    cached: Any  # Gauge
    evictions: Any

    @classmethod
    def of(cls, metrics: ServiceMetrics, labels: dict[str, str]) -> PrefixMetrics:
        return cls(
            metrics.prefix_cache_queried_tokens.labels(**labels),
            metrics.prefix_cache_hit_tokens.labels(**labels),
            metrics.prefix_cache_bytes.labels(**labels),
            metrics.prefix_cache_evictions.labels(**labels),
        )


class PrefixReuse:
    """One model's prefix cache as its engine loop uses it (`enabled` False: every call is a no-op)."""

    def __init__(self, store: KVStore, model: str, enabled: bool, metrics: PrefixMetrics) -> None:
        self.store, self.model, self.enabled, self.metrics = store, model, enabled, metrics
        self._evictions_seen = 0

    def _key(self, request: Request, token_ids: list[int]) -> tuple[tuple[str, str, str], list[int]] | None:
        """The chain's extra key and hashes, or None when the request does not take part."""
        policy = request.cache_policy
        if not self.enabled or policy.cached(len(token_ids)) < len(token_ids):
            return None
        extra = (self.model, policy.form, request.cache_salt)
        return extra, block_hashes(token_ids, self.store.block_size, extra)

    def peek(self, request: Request) -> int:
        """Prompt tokens a lookup would find now, noted on the request (admission's estimate; any thread)."""
        key = self._key(request, request.prompt_ids)
        if key is None:
            return 0
        found = self.store.peek_cached(request.prompt_ids, key[1], key[0])
        request.cached_prompt_tokens = min(found, len(request.prompt_ids) - 1)
        return request.cached_prompt_tokens

    def blocks_of(self, request: Request) -> frozenset[int]:
        """The keys of the prefix cache's blocks of the request's prompt (cached or not: the
        scheduler keeps the cached ones from being evicted before `take`)."""
        key = self._key(request, request.prefill_ids)
        return frozenset(key[1]) if key is not None else frozenset()

    def take(self, request: Request, exact: int | None = None) -> CachedPast | None:
        """The cached K/V of the request's leading prefill tokens (None: a miss), at most its first
        `exact` (those a fresh prefill would compute alike). At least the last token is always
        computed: its logits are the first token's."""
        token_ids = request.prefill_ids
        key = self._key(request, token_ids)
        if key is None:
            return None
        extra, hashes = key
        limit = len(token_ids) - 1 if exact is None else min(len(token_ids) - 1, exact)
        past = self.store.cached_past(token_ids, hashes, extra, limit)
        tokens = 0 if past is None else past.tokens
        if request.attempt == 0:  # a preempted request's usage keeps its first attempt's figure
            self.metrics.queried.inc(len(token_ids))
            self.metrics.hit.inc(tokens)
            request.cached_prompt_tokens = tokens
        return past

    def keep(self, request: Request, prompt: PrefilledPrompt, exact: int | None = None) -> None:
        """The full blocks of a prompt just written into its row (engine thread), of its first
        `exact` tokens only when the rest is not what a fresh prefill computes (reused segments)."""
        token_ids = request.prefill_ids
        key = self._key(request, token_ids)
        if key is None or prompt.length != len(token_ids):
            return
        extra, hashes = key
        if exact is not None:
            hashes = hashes[: exact // self.store.block_size]
        self.store.cache_prompt(token_ids, hashes, extra, prompt.cache, request.cache_policy.form)

    def held_by_form(self) -> dict[str, int]:
        return self.store.prefix.bytes_by_form()

    def update_gauges(self) -> None:
        prefix = self.store.prefix
        self.metrics.cached.set(prefix.nbytes)
        if prefix.evictions > self._evictions_seen:
            self.metrics.evictions.inc(prefix.evictions - self._evictions_seen)
            self._evictions_seen = prefix.evictions
