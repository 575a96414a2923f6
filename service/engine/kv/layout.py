"""What one token's K/V cache is made of: the model's layer groups (kv/spec.py), made here from its
manifest, and the storage kinds a row can have under a request's cache policy."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from contract.cache_policy import INT8, INT8_CHANNEL, CachePolicy
from contract.kv_spec import LayerCacheSpec
from contract.manifest import CacheEviction, LocalCache, Manifest
from service.engine.kv.spec import FullAttentionSpec, RowEviction, SlidingWindowSpec, StorageSpec, attention_spec

# The storage kinds (contract.cache_policy): float rows' kind is the layout's dtype; INT8 rows hold int8
# values with per-token scales, INT8_CHANNEL rows int8 values with the model's fixed per-channel scales.
__all__ = ["INT8", "INT8_CHANNEL", "KVLayout", "serving_layout", "sliding_window"]


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's cache: `n_layers` layers, each caching its `cache` (contract.kv_spec; by
    default a K and a V of `n_heads` x `head_dim`), in two groups at most:

    - `full` (FullAttentionSpec, or LatentAttentionSpec): the layers a row keeps every token of
      (`tensors`, `token_bytes`): every layer unless a group is kept apart;
    - `local` (SlidingWindowSpec): a hybrid served with per-group caches keeps its local layers'
      K/V apart, a fixed number of columns a row, since a local layer never attends further back than
      its window."""

    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str  # float32 | float16
    # The fixed per-channel scales of INT8_CHANNEL rows, (2 x layers, heads, 1, head_dim) float32, or
    # None: the model's export has no graph that reads them, and unbounded int8 rows are INT8 rows.
    channel_scales: np.ndarray | None = field(default=None, compare=False, repr=False)
    local: SlidingWindowSpec | None = None  # the layers kept apart, bounded by their window
    cache: LayerCacheSpec | None = None  # what a layer caches per token (None: K and V of every head)
    # Where positions go once a bounded policy evicts (the manifest's `cache_eviction`; None: the
    # scheme serves no bounded policy).
    positions: CacheEviction | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        layer = self.layer_cache
        assert (layer.heads, layer.width) == (self.n_heads, self.head_dim), "a layer's cache is n_heads x head_dim"
        assert self.local is None or (self.local.cache, self.local.dtype) == (layer, self.dtype)

    @property
    def layer_cache(self) -> LayerCacheSpec:
        return self.cache or LayerCacheSpec.full(self.n_heads, self.head_dim)

    @functools.cached_property
    def full(self) -> FullAttentionSpec:
        """The layers whose cache grows with the sequence (every layer when none is kept apart)."""
        kept_apart = self.local.layers if self.local else ()
        layers = tuple(layer for layer in range(self.n_layers) if layer not in kept_apart)
        return attention_spec(layers, self.layer_cache, self.dtype)

    @property
    def entries(self) -> tuple[str, ...]:
        """What a layer caches per token (graph name suffixes)."""
        return self.layer_cache.entries

    @property
    def per_layer(self) -> int:
        """Cache tensors a layer keeps per token (2: K and V; 1: latent attention's one entry)."""
        return self.layer_cache.per_layer

    @property
    def rotated_columns(self) -> tuple[int, int]:
        """The columns of a layer's first entry that carry a rotation (latent attention: its rotated key's)."""
        return self.layer_cache.rotated_columns

    @property
    def split(self) -> bool:
        """A group is kept apart (`local`), bounded by its window."""
        return self.local is not None

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers whose K/V grow with the sequence (every layer when not split)."""
        return self.full.layers

    @property
    def tensors(self) -> int:
        """Cache tensors per token of the row's main array (the full group's)."""
        return self.full.tensors

    @property
    def token_bytes(self) -> int:
        return self.full.token_bytes

    @property
    def local_row_bytes(self) -> int:
        """The local columns of a row of a class at least the local width wide (0 when not split)."""
        return 0 if self.local is None else self.local.width * self.local.token_bytes

    @property
    def repair_tokens(self) -> int:
        """Tokens one prompt call recomputes, after the global K/V of a prefix-cache hit, to rebuild the
        local layers' window before it when the cache kept none there: a layer's K/V at a token are exact
        once its input is, and each local layer reaches `window - 1` tokens further back, so with every
        local layer below every global one (whose K/V the cache holds) the last window is exact after
        `local layers x (window - 1)` tokens. 0: not split, or a global layer below a local one (its
        output would need the call's own, inexact, global K/V)."""
        local = self.local
        if local is None or (self.full.layers and max(local.layers) > min(self.full.layers)):
            return 0
        return len(local.layers) * local.keep_tokens

    def row_bytes(self, capacity: int, kind: str) -> int:
        """One row of a class of `capacity` tokens and storage `kind`: its global columns and its local ones."""
        local = 0 if self.local is None else self.local.row_bytes(capacity)
        return capacity * self.full.kind_token_bytes(kind) + local

    def storage(self, kind: str) -> StorageSpec:
        """The typed spec of rows of a storage kind (what callers ask instead of comparing kinds)."""
        return StorageSpec(kind, self.full.kind_token_bytes(kind))

    def row_eviction(self, policy: CachePolicy) -> RowEviction:
        """A new row's eviction state under a request's cache policy."""
        return RowEviction.of(policy, self.positions)

    def kind_of(self, policy: CachePolicy) -> str:
        """The storage kind of a row under a cache policy, on this model (CachePolicy.kind: INT8_CHANNEL
        only where the model has the channel scales its fused int8 graph reads)."""
        return policy.kind(self.dtype, self.channel_scales is not None)


def local_width(window: int, block_size: int) -> int:
    """A row's local columns: the window's past (window - 1 tokens) and the step's token, as much
    again of slack so that a full row shifts its window back once every `window` steps instead of
    every step (a speculative block of up to that many tokens fits too), and a block, so a computed
    prompt hands the prefix cache the window before its last full block (prefix.py)."""
    return 2 * window + block_size


def sliding_window(
    layers: tuple[int, ...], window: int, block_size: int, cache: LayerCacheSpec, dtype: str
) -> SlidingWindowSpec:
    """The spec of a hybrid's local layers kept apart, `local_width` columns a row."""
    return SlidingWindowSpec(tuple(layers), cache, dtype, window, local_width(window, block_size))


def serving_layout(
    manifest: Manifest, dtype: str, channel_scales: np.ndarray | None, local: LocalCache | None, block_size: int
) -> KVLayout:
    """The store's layout, the one place the layer groups are made from a manifest: every layer's cache
    per token, or with `local` (the manifest's `local_cache`, where the fused graphs that read it serve)
    the full group's per token and the local layers' in a window's columns a row."""
    cache = manifest.kv_spec
    window = None if local is None else sliding_window(tuple(local.layers), local.window, block_size, cache, dtype)
    return KVLayout(
        manifest.n_layers, cache.heads, cache.width, dtype, channel_scales, window, cache, manifest.cache_eviction
    )
