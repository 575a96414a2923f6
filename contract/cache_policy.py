"""Cache-budget policies: which tokens a sequence's K/V cache keeps and how it stores them. One
grammar and one meaning, shared by the service (which runs them), the PyTorch reference (which
checks them), the report and the clients.

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

`CachePolicy` answers what callers need of a policy: the tokens it keeps (`cached`, `budget`,
`keeps`), the room it leaves before it evicts (`room`), how it stores (`kind`) and the graph that
reads those rows (`variant`), where eviction places positions (`original_positions`), and what a
model's export must have to serve it (`missing`). A model whose layers form groups (a hybrid's
sliding-window local layers and its global layers) holds a policy per group (`within`, `group`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from contract.manifest import SERVING_FUSED_INT8, SERVING_INT8, serving_variant

if TYPE_CHECKING:
    from contract.manifest import CacheEviction, Manifest

FIELD = "cache_policy"
FULL = "full"
INT8 = "int8"  # the int8 storage, and the storage kind of int8 rows with per-token scales
INT8_CHANNEL = "int8-channel"  # int8 rows with the model's fixed per-channel scales (contract/kv_int8.py)
_INT8_SUFFIX = "+" + INT8


def kind_variant(kind: str) -> str:
    """The serving graph variant that reads rows of a storage kind (serving-<dtype> for float rows)."""
    return {INT8: SERVING_INT8, INT8_CHANNEL: SERVING_FUSED_INT8}.get(kind) or serving_variant(kind)


class CachePolicyError(ValueError):
    """A policy string that does not parse, or does not fit the model or the server."""


@dataclass(frozen=True)
class _Tokens:
    """Which tokens a form keeps: its name (a form's first part), its syntax and its pattern."""

    name: str
    syntax: str
    pattern: re.Pattern[str]


# The grammar, in one place: the tokens a policy keeps, each optionally stored as int8 ("+int8";
# `full` in int8 is written `int8`). Parsing, printing and the forms all come from these.
_TOKENS = (
    _Tokens(FULL, FULL, re.compile(r"full|")),
    _Tokens("window", "window:W", re.compile(r"window:(?P<window>\d+)")),
    _Tokens("sinks", "sinks:S+window:W", re.compile(r"sinks:(?P<sinks>\d+)\+window:(?P<window>\d+)")),
)
_STORAGES = ("", _INT8_SUFFIX)


def _written(tokens: str, storage: str) -> str:
    """A form's tokens part and storage suffix as written (full in int8: `int8`)."""
    return INT8 if tokens == FULL and storage else tokens + storage


# A policy's form, its numbers left out (a metric label of bounded cardinality) -> the syntax
# ListModels shows for it; in the grammar's order.
FORM_SYNTAX = {_written(t.name, s): _written(t.syntax, s) for s in _STORAGES for t in _TOKENS}
POLICY_FORMS = "full, window:W or sinks:S+window:W, each optionally +int8 (int8 alone: full in int8)"


@dataclass(frozen=True)
class CachePolicy:
    sinks: int = 0
    window: int | None = None  # None: full
    int8: bool = False  # K/V stored as int8 with per-token scales (contract/kv_int8.py)
    # Per layer group, where a model's layers attend alike in groups and a group keeps other tokens
    # than the policy names (`within`): (group name, its policy), every group listed. Empty: every
    # layer follows this policy.
    groups: tuple[tuple[str, CachePolicy], ...] = ()

    @property
    def bounded(self) -> bool:
        return self.window is not None

    @property
    def keeps(self) -> str:
        """Which tokens it keeps, by name: full, window or sinks (a form without its storage)."""
        return FULL if self.window is None else "sinks" if self.sinks else "window"

    @property
    def budget(self) -> int | None:
        """Most tokens the cache holds (None: unbounded); with groups, the most any group holds."""
        if self.groups:
            budgets = [policy.budget for _, policy in self.groups]
            return None if None in budgets else max(b for b in budgets if b is not None)
        return None if self.window is None else self.sinks + self.window

    @functools.cached_property
    def form(self) -> str:
        """The policy without its numbers (a key of FORM_SYNTAX): what a metric's `policy` label
        carries, so the label has six values however many budgets clients ask for. Cached: the
        output processor asks for it once per token."""
        return _written(self.keeps, _INT8_SUFFIX if self.int8 else "")

    def cached(self, tokens: int) -> int:
        """Tokens in the cache once `tokens` tokens have gone through it (with groups: the most any
        group holds, which a row of the whole sequence must hold)."""
        budget = self.budget
        return tokens if budget is None else min(tokens, budget)

    def room(self, tokens: int) -> int | None:
        """Tokens it can add after `tokens` before it first evicts one (None: it never evicts). A
        block of tokens fed in one call must fit this room: each later token of a block that evicts
        would see one old token fewer, which one mask for the block cannot say."""
        if self.groups:
            rooms = [room for _, policy in self.groups if (room := policy.room(tokens)) is not None]
            return min(rooms, default=None)
        budget = self.budget
        return None if budget is None else max(budget - tokens, 0)

    def kind(self, dtype: str, channel_scales: bool) -> str:
        """How it stores its rows (the store's storage kind): the model's float `dtype`, or int8:
        with the model's per-channel scales where its export reads them inside the fused kernel
        (`channel_scales`) and the policy never evicts, else with per-token scales (bounded rows
        shift and re-index in place, which only the explicit graph does)."""
        if not self.int8:
            return dtype
        return INT8_CHANNEL if channel_scales and not self.bounded else INT8

    def variant(self, dtype: str, channel_scales: bool) -> str:
        """The serving graph variant that reads its rows (the fused float graph may serve rows of
        a policy that never evicts too, where the engine has it: contract.manifest.FusedAttention)."""
        return kind_variant(self.kind(dtype, channel_scales))

    def original_positions(self, eviction: CacheEviction | None) -> bool:
        """Where a row's next positions come from once it has evicted: counted from the sequence's
        start (True), or within the cache (the scheme's `eviction` rule: contract.manifest). A policy
        that never evicts counts from the start."""
        if not self.bounded:
            return True
        if eviction is None:
            raise CachePolicyError(f"{FIELD}: {self} evicts, and the model's export has no eviction rule")
        return eviction.feeds_original_positions

    def missing(self, manifest: Manifest) -> str | None:
        """What the model's export lacks to serve this policy (None: nothing), as an error's reason."""
        if (self.bounded or self.int8) and not manifest.kv_spec.key_value:  # the int8 graphs and eviction need K and V
            return (
                f"does not serve {self.form!r}: its latent attention cache (one [latent; rotated key] of "
                f"{manifest.kv_spec.width} numbers a token and layer) has neither an int8 graph nor eviction; "
                "it serves full"
            )
        if self.bounded and manifest.is_hybrid:
            return (
                f"does not serve {self.form!r}: its local layers already keep only their sliding window, and a "
                "window on its global layer alone is not built; it serves full"
            )
        if self.int8 and manifest.local_cache is not None:
            return (
                f"does not serve {self.form!r}: its local layers keep their window's K/V in columns of their own, "
                "which only the float32 fused graphs read; it serves full"
            )
        if self.bounded and manifest.cache_eviction is None:
            return "was exported before cache policies and serves only full; re-export it (python -m export)"
        if self.int8 and not manifest.has_int8_cache:
            return f"was exported without the int8 cache graph ({SERVING_INT8}); re-export it (python -m export)"
        return None

    def exact_tokens(self, tokens: int) -> int:
        """How many of a text's first `tokens` one call computes exactly as this cache would show
        them to each other: all it keeps in float storage; under int8 only the first (each later
        token must see the int8 K/V of those before it)."""
        return 1 if self.int8 else self.cached(tokens)

    def within(self, windows: Mapping[str, int | None]) -> CachePolicy:
        """This policy on a model whose layer groups see at most `windows[group]` tokens each (None:
        every token): each group keeps what its layers can see of what the policy keeps. A group
        that sees the last W tokens keeps `window:W` (in the policy's storage) where the policy keeps
        more, or the policy itself where it keeps W or fewer."""
        groups = []
        for name, window in windows.items():
            policy = replace(self, groups=())
            if window is not None and (policy.budget is None or policy.budget > window):
                if policy.bounded and (policy.window or 0) < window:
                    raise CachePolicyError(
                        f"{FIELD}: {policy} keeps sinks beyond the last {window} tokens that layer group "
                        f"{name!r} sees; use window:W, full or int8"
                    )
                policy = CachePolicy(0, window, self.int8)
            groups.append((name, policy))
        return replace(self, groups=tuple(groups))

    def group(self, name: str) -> CachePolicy:
        """The policy of one layer group (this one where it has no groups)."""
        return dict(self.groups).get(name, self) if self.groups else self

    def __str__(self) -> str:
        tokens = FULL if self.window is None else f"window:{self.window}"
        if self.sinks:
            tokens = f"sinks:{self.sinks}+{tokens}"
        return _written(tokens, _INT8_SUFFIX if self.int8 else "")


FULL_POLICY = CachePolicy()


def _example(tokens: _Tokens, storage: str) -> CachePolicy:
    numbers = tokens.pattern.groupindex
    return CachePolicy(int("sinks" in numbers), 1 if "window" in numbers else None, bool(storage))


# One policy of each form (its numbers 1), in the grammar's order: what a form needs of a model is
# what its policies need (CachePolicy.missing).
FORM_POLICIES = {_written(t.name, s): _example(t, s) for s in _STORAGES for t in _TOKENS}


def parse_cache_policy(text: str, max_budget: int | None = None) -> CachePolicy:
    """A policy from its string ("" means full); errors name the field, the forms and the limit (and
    the tokens part, where a +int8 policy's numbers are wrong)."""
    text = text.strip()
    int8 = text == INT8 or text.endswith(_INT8_SUFFIX)
    tokens = text.removesuffix(_INT8_SUFFIX)
    tokens = FULL if tokens == INT8 else tokens  # int8 is full in int8 (and int8+int8 is not a policy)
    match = next((m for t in _TOKENS if (m := t.pattern.fullmatch(tokens))), None)
    if match is None:
        raise CachePolicyError(f"{FIELD}: {tokens!r} is not a cache policy; expected {POLICY_FORMS} (W, S integers)")
    numbers = match.groupdict()
    if "window" not in numbers:
        if int8 and text != INT8:  # full+int8 is written int8
            raise CachePolicyError(f"{FIELD}: {text!r} is not a cache policy; expected {POLICY_FORMS}")
        return CachePolicy(int8=int8)
    sinks, window = int(numbers.get("sinks") or 0), int(numbers["window"])
    if "sinks" in numbers and sinks < 1:
        raise CachePolicyError(f"{FIELD}: {tokens!r}: sinks must be at least 1 (or use window:W)")
    if window < 1:
        raise CachePolicyError(f"{FIELD}: {tokens!r}: window must be at least 1 token")
    if max_budget is not None and sinks + window > max_budget:
        raise CachePolicyError(
            f"{FIELD}: {tokens!r} keeps {sinks + window} tokens, more than this server's longest sequence "
            f"({max_budget} tokens); use full, or a smaller window"
        )
    return CachePolicy(sinks, window, int8)
