"""Cache policies as objects (contract/cache_policy.py), pure logic: one grammar for parsing,
printing and the forms; what a policy keeps, the room it leaves, how it stores and which graph reads
it, where eviction puts positions, what it needs of a model; and a policy per layer group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from contract.cache_policy import (
    FORM_POLICIES,
    FORM_SYNTAX,
    FULL_POLICY,
    INT8,
    INT8_CHANNEL,
    CachePolicy,
    CachePolicyError,
    parse_cache_policy,
)
from contract.kv_spec import LayerCacheSpec
from contract.manifest import SERVING_FUSED_INT8, SERVING_INT8, CacheEviction


def test_the_forms_come_from_the_grammar_and_every_form_parses_back_to_itself() -> None:
    assert list(FORM_SYNTAX) == ["full", "window", "sinks", "int8", "window+int8", "sinks+int8"]
    assert FORM_SYNTAX["sinks+int8"] == "sinks:S+window:W+int8" and FORM_SYNTAX["int8"] == "int8"
    for form, policy in FORM_POLICIES.items():
        assert policy.form == form
        assert parse_cache_policy(str(policy)) == policy
    for text in ("window:64", "sinks:4+window:60+int8", "int8", "full"):
        assert str(parse_cache_policy(text)) == text
    assert parse_cache_policy("") == FULL_POLICY
    for bad in ("full+int8", "int8+int8", "window:0", "sinks:0+window:4", "window:8+int4", "Window:8"):
        with pytest.raises(CachePolicyError, match="cache_policy"):
            parse_cache_policy(bad)


def test_a_policy_says_what_it_keeps_and_how_much_room_it_leaves_before_it_evicts() -> None:
    full, window, sinks = (parse_cache_policy(t) for t in ("full", "window:64", "sinks:4+window:60"))
    assert (full.cached(1000), window.cached(1000), window.cached(10)) == (1000, 64, 10)
    assert (full.keeps, window.keeps, sinks.keeps) == ("full", "window", "sinks")
    assert (full.budget, sinks.budget) == (None, 64)
    assert full.room(1000) is None and window.room(60) == 4 and window.room(70) == 0


def test_a_policy_says_how_it_stores_and_which_graph_reads_its_rows() -> None:
    full, int8, bounded_int8 = (parse_cache_policy(t) for t in ("full", "int8", "window:64+int8"))
    assert full.kind("float16", channel_scales=True) == "float16"
    assert int8.kind("float32", channel_scales=True) == INT8_CHANNEL  # read inside the fused kernel
    assert int8.kind("float32", channel_scales=False) == INT8
    assert bounded_int8.kind("float32", channel_scales=True) == INT8  # bounded rows shift: per-token scales
    assert full.variant("float32", True) == "serving-float32"
    assert int8.variant("float32", True) == SERVING_FUSED_INT8 and bounded_int8.variant("float32", True) == SERVING_INT8
    assert int8.exact_tokens(100) == 1 and full.exact_tokens(100) == 100  # each int8 token sees int8 K/V
    assert parse_cache_policy("window:8").exact_tokens(100) == 8


def test_where_eviction_puts_positions_and_what_a_model_must_have() -> None:
    window = parse_cache_policy("window:64")
    assert FULL_POLICY.original_positions(None)  # never evicts: positions count from the start
    assert not window.original_positions(CacheEviction("cache"))
    assert window.original_positions(CacheEviction("original"))
    with pytest.raises(CachePolicyError, match="no eviction rule"):
        window.original_positions(None)
    full_attention = LayerCacheSpec.full(4, 32)
    old = SimpleNamespace(
        cache_eviction=None, has_int8_cache=False, is_hybrid=False, local_cache=None, kv_spec=full_attention
    )
    assert FULL_POLICY.missing(old) is None  # type: ignore[arg-type]
    assert "before cache policies" in (window.missing(old) or "")  # type: ignore[arg-type]
    assert "serving-int8" in (parse_cache_policy("int8").missing(old) or "")  # type: ignore[arg-type]
    latent = SimpleNamespace(**{**vars(old), "kv_spec": LayerCacheSpec.latent(64, 16)})
    assert FULL_POLICY.missing(latent) is None  # type: ignore[arg-type]
    for policy in ("int8", "window:64", "sinks:4+window:60"):
        assert "latent attention" in (parse_cache_policy(policy).missing(latent) or "")  # type: ignore[arg-type]


def test_a_policy_holds_one_policy_per_layer_group() -> None:
    """A hybrid's local layers see the last 128 tokens, its global layer all: under `full` the local
    group keeps its window, the global group everything; the whole keeps what its largest group keeps
    and evicts as soon as any group does."""
    windows = {"local": 128, "global": None}
    full = FULL_POLICY.within(windows)
    assert full.group("local") == CachePolicy(0, 128) and full.group("global") == FULL_POLICY
    assert full.form == "full" and full.cached(1000) == 1000 and full.budget is None and full.room(100) == 28
    assert parse_cache_policy("int8").within(windows).group("local") == parse_cache_policy("window:128+int8")
    small = parse_cache_policy("sinks:4+window:60").within(windows)
    assert small.group("local") == small.group("global") == parse_cache_policy("sinks:4+window:60")
    assert parse_cache_policy("window:512").within(windows).group("local") == CachePolicy(0, 128)
    with pytest.raises(CachePolicyError, match="keeps sinks beyond the last 128 tokens"):
        parse_cache_policy("sinks:100+window:60").within(windows)
    assert FULL_POLICY.group("local") == FULL_POLICY  # no groups: every layer follows it


def test_a_hybrid_refuses_bounded_policies_naming_the_form() -> None:
    full = LayerCacheSpec.full(4, 32)
    hybrid = SimpleNamespace(cache_eviction=None, has_int8_cache=True, is_hybrid=True, local_cache=None, kv_spec=full)
    assert "'window'" in (parse_cache_policy("window:64").missing(hybrid) or "")  # type: ignore[arg-type]
    assert parse_cache_policy("int8").missing(hybrid) is None  # type: ignore[arg-type]
    assert FULL_POLICY.missing(hybrid) is None  # type: ignore[arg-type]
    # Served with per-group caches (contract.manifest.LocalCache), whose local columns only the fused
    # float32 graphs read: int8 is refused, named.
    split = SimpleNamespace(**{**vars(hybrid), "local_cache": object()})
    assert "'int8'" in (parse_cache_policy("int8").missing(split) or "")  # type: ignore[arg-type]
    assert FULL_POLICY.missing(split) is None  # type: ignore[arg-type]
