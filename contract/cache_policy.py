"""Cache-budget policies: which tokens a sequence's K/V cache keeps. One grammar and one meaning,
shared by the service (which runs them), the PyTorch reference (which checks them) and the clients.

    full                every token stays (the default)
    window:W            the last W tokens
    sinks:S+window:W    the first S tokens ("attention sinks", StreamingLLM: Xiao et al. 2023,
                        https://arxiv.org/abs/2309.17453) and the last W
    int8, window:W+int8, sinks:S+window:W+int8
                        the same tokens, their K/V stored as int8 with one float32 scale per
                        token and head (contract/kv_int8.py): about 28% of float32's bytes

A bounded policy holds at most its budget B = S + W tokens. Each token attends to the cached
tokens and to itself (at most B + 1 keys); after its step, when the cache already holds B tokens,
the oldest token that is not a sink is evicted to make room for it. A prompt longer than B is
computed the same way (its first B tokens at once, then one token at a time), so what a token
sees never depends on how its text arrived.

Positions after eviction are the scheme's own decision (`eviction_positions` in the manifest):
- `cache`: distances within the cache (relative bias, ALiBi, RoPE, none), as StreamingLLM
  re-indexes: the sinks sit right before the window, and the new token right after it;
- `original`: absolute schemes (sinusoidal, learned) bake each token's position into its keys,
  which cannot be re-indexed; new tokens keep counting from the start of the sequence, so a
  bounded table (`learned`) still ends the sequence at its last position.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

FIELD = "cache_policy"
FULL = "full"
_WINDOW = re.compile(r"window:(\d+)")
_SINKS = re.compile(r"sinks:(\d+)\+window:(\d+)")
INT8 = "int8"
_INT8_SUFFIX = "+" + INT8
POLICY_FORMS = "full, window:W or sinks:S+window:W, each optionally +int8 (int8 alone: full in int8)"
# A policy's form, its numbers left out: a metric label of bounded cardinality, and the syntax
# ListModels shows for it.
FORM_SYNTAX = {
    FULL: FULL,
    "window": "window:W",
    "sinks": "sinks:S+window:W",
    INT8: INT8,
    "window" + _INT8_SUFFIX: "window:W" + _INT8_SUFFIX,
    "sinks" + _INT8_SUFFIX: "sinks:S+window:W" + _INT8_SUFFIX,
}


class CachePolicyError(ValueError):
    """A policy string that does not parse, or does not fit the model or the server."""


@dataclass(frozen=True)
class CachePolicy:
    sinks: int = 0
    window: int | None = None  # None: full
    int8: bool = False  # K/V stored as int8 with per-token scales (contract/kv_int8.py)

    @property
    def bounded(self) -> bool:
        return self.window is not None

    @property
    def budget(self) -> int | None:
        """Most tokens the cache holds (None: unbounded)."""
        return None if self.window is None else self.sinks + self.window

    @functools.cached_property
    def form(self) -> str:
        """The policy without its numbers (a key of FORM_SYNTAX): what a metric's `policy` label
        carries, so the label has six values however many budgets clients ask for. Cached: the
        output processor asks for it once per token."""
        if self.window is None:
            return INT8 if self.int8 else FULL
        tokens = "sinks" if self.sinks else "window"
        return tokens + _INT8_SUFFIX if self.int8 else tokens

    def cached(self, tokens: int) -> int:
        """Tokens in the cache once `tokens` tokens have gone through it."""
        return tokens if self.window is None else min(tokens, self.sinks + self.window)

    def __str__(self) -> str:
        if self.window is None:
            return INT8 if self.int8 else FULL
        tokens = f"window:{self.window}" if not self.sinks else f"sinks:{self.sinks}+window:{self.window}"
        return tokens + _INT8_SUFFIX if self.int8 else tokens


FULL_POLICY = CachePolicy()


def parse_cache_policy(text: str, max_budget: int | None = None) -> CachePolicy:
    """A policy from its string ("" means full); errors name the field, the forms and the limit."""
    text = text.strip()
    if text == INT8:
        return CachePolicy(int8=True)
    if text.endswith(_INT8_SUFFIX):
        tokens = parse_cache_policy(text.removesuffix(_INT8_SUFFIX), max_budget)
        if not tokens.bounded or tokens.int8:
            raise CachePolicyError(f"{FIELD}: {text!r} is not a cache policy; expected {POLICY_FORMS}")
        return CachePolicy(tokens.sinks, tokens.window, int8=True)
    if text in ("", FULL):
        return FULL_POLICY
    if match := _SINKS.fullmatch(text):
        sinks, window = int(match.group(1)), int(match.group(2))
        if sinks < 1:
            raise CachePolicyError(f"{FIELD}: {text!r}: sinks must be at least 1 (or use window:W)")
    elif match := _WINDOW.fullmatch(text):
        sinks, window = 0, int(match.group(1))
    else:
        raise CachePolicyError(f"{FIELD}: {text!r} is not a cache policy; expected {POLICY_FORMS} (W, S integers)")
    if window < 1:
        raise CachePolicyError(f"{FIELD}: {text!r}: window must be at least 1 token")
    if max_budget is not None and sinks + window > max_budget:
        raise CachePolicyError(
            f"{FIELD}: {text!r} keeps {sinks + window} tokens, more than this server's longest sequence "
            f"({max_budget} tokens); use full, or a smaller window"
        )
    return CachePolicy(sinks, window)
