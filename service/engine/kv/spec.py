"""The typed specs the KV store is made of, each made in one place from the model's manifest and the
request's CachePolicy (kv/layout.py), so that the worker and speculative decoding ask them rather than
compare storage-kind strings, layer kinds or windows themselves:

- a layer group's spec (as vLLM's kv_cache_interface.py): `FullAttentionSpec` (layers that keep every
  token's K/V), `LatentAttentionSpec` (latent attention's one [latent; rotated key] entry a token, every
  token) and `SlidingWindowSpec` (a hybrid's local layers, a fixed number of columns a row);
- `StorageSpec`: what rows of one storage kind are and what the graphs may do with them;
- `RowEviction`: what a row's bounded policy keeps and where its positions go once it evicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.cache_policy import INT8, INT8_CHANNEL, CachePolicy, kind_variant
from contract.kv_spec import FULL_ATTENTION, LATENT_ATTENTION, LayerCacheSpec
from contract.manifest import DTYPE_BYTES, INT8_SCALE_BYTES, CacheEviction
from service.engine.kv.arrays import Array

FLOAT32 = "float32"


def fused_float(dtype: str) -> bool:
    """Float rows of this dtype are what the fused float graphs (decode and prompt) read and write in
    place: they are exported float32."""
    return dtype == FLOAT32


@dataclass(frozen=True)
class LayerGroupSpec:
    """Layers whose cache behaves alike: which layers, what each caches per token (`cache`, the
    manifest's contract.kv_spec), in what float dtype; `columns` says how many tokens a row keeps."""

    layers: tuple[int, ...]
    cache: LayerCacheSpec
    dtype: str

    @property
    def tensors(self) -> int:
        """Cache tensors a token has in these layers (per layer: the cache's entries)."""
        return self.cache.per_layer * len(self.layers)

    @property
    def token_bytes(self) -> int:
        """One token's cache in these layers, as float rows hold it."""
        return self.tensors * self.cache.heads * self.cache.width * DTYPE_BYTES[self.dtype]

    def columns(self, capacity: int) -> int:
        """The tokens a row of a class `capacity` tokens wide keeps of these layers."""
        raise NotImplementedError

    def row_bytes(self, capacity: int) -> int:
        return self.columns(capacity) * self.token_bytes


@dataclass(frozen=True)
class FullAttentionSpec(LayerGroupSpec):
    """Layers that attend to every token before: a row keeps every token's K/V, so the group grows with
    the sequence, in rows of any storage kind (`kind_token_bytes`)."""

    def columns(self, capacity: int) -> int:
        return capacity

    def kind_token_bytes(self, kind: str) -> int:
        """One token's bytes in rows of a storage kind (INT8: int8 values plus a float32 scale per head;
        INT8_CHANNEL: int8 values, the scales being the model's)."""
        if kind == INT8:
            return self.tensors * self.cache.heads * (self.cache.width + INT8_SCALE_BYTES)
        if kind == INT8_CHANNEL:
            return self.tensors * self.cache.heads * self.cache.width
        return self.token_bytes


@dataclass(frozen=True)
class LatentAttentionSpec(FullAttentionSpec):
    """Latent attention (`mla`): one [latent; rotated key] entry of one shared head a token, every token
    kept; only its rotated key's columns carry a position (`cache.rotated_columns`). Its export has no
    int8 graph and it serves no bounded policy (contract.cache_policy refuses them), so its rows are
    float rows only."""


# The group spec of a layer kind (contract.kv_spec): a new kind of attention is one more entry here.
ATTENTION_SPECS: dict[str, type[FullAttentionSpec]] = {
    FULL_ATTENTION: FullAttentionSpec,
    LATENT_ATTENTION: LatentAttentionSpec,
}


def attention_spec(layers: tuple[int, ...], cache: LayerCacheSpec, dtype: str) -> FullAttentionSpec:
    """The spec of layers that keep every token, by the kind of cache the manifest declares."""
    return ATTENTION_SPECS[cache.kind](layers, cache, dtype)


@dataclass(frozen=True)
class SlidingWindowSpec(LayerGroupSpec):
    """A hybrid's local layers, kept apart from the others (service/engine/kv/local.py): a local layer
    attends to its last `window` tokens (its query's own included), so a row keeps `width` columns of
    them at most (kv/layout.py's `local_width`: the window, slack for shifts and guesses, a block),
    whatever the sequence's length. Float rows only."""

    window: int
    width: int

    def columns(self, capacity: int) -> int:
        """Never more than the row's own tokens, so a short row never pays for the window's slack."""
        return min(capacity, self.width)

    @property
    def keep_tokens(self) -> int:
        """The tokens before a new one that its local layers read: what a shift or a chunk keeps."""
        return self.window - 1


@dataclass(frozen=True)
class StorageSpec:
    """Rows of one storage kind: the layout's float dtype, INT8 (per-token scales) or INT8_CHANNEL
    (the model's fixed per-channel scales, read and written inside the fused int8 kernel)."""

    kind: str
    token_bytes: int  # one token's cache in such rows (a split row's local columns apart)

    @property
    def quantized(self) -> bool:
        return self.kind in (INT8, INT8_CHANNEL)

    @property
    def variant(self) -> str:
        """The serving graph that decodes these rows (and the key of its session)."""
        return kind_variant(self.kind)

    @property
    def activations(self) -> str:
        """The dtype of that graph's activations and outputs (logits, new K/V): float32 for int8 rows."""
        return FLOAT32 if self.quantized else self.kind

    @property
    def scaled(self) -> bool:
        """Each token's K/V come with their own scales, a second cache array the graph is fed."""
        return self.kind == INT8

    @property
    def written_by_kernel(self) -> bool:
        """The fused int8 graph decodes these rows in place, one token a call, writing each token's
        quantized K/V into the row itself (the caller appends nothing)."""
        return self.kind == INT8_CHANNEL

    @property
    def verifies_blocks(self) -> bool:
        """Its graph takes several tokens a row in one call, so speculative guesses verify in it."""
        return not self.written_by_kernel

    @property
    def full_float32(self) -> bool:
        """Float32 rows: what the fused float graphs (decode and prompt) read and write in place."""
        return fused_float(self.kind)


@dataclass
class RowEviction:
    """A row's bounded policy and its eviction state (`KVLayout.row_eviction` makes it from a CachePolicy).

    `budget` 0 is `full`. A bounded row never holds more than `budget` tokens: the step that would
    exceed it first evicts the oldest token after the `sinks` (its row shifts left by one column,
    a copy of at most `budget` tokens, the same every step). `original_positions`: the next
    position counts evicted tokens too (absolute schemes, and RoPE, whose sink keys are instead
    moved by `evicted` positions from `anchor`, their keys before the first eviction)."""

    budget: int = 0
    sinks: int = 0
    original_positions: bool = True
    evicted: int = 0
    anchor: Array | None = None  # (n_layers, heads, sinks, head_dim), RoPE sinks only

    @classmethod
    def of(cls, policy: CachePolicy, positions: CacheEviction | None) -> RowEviction:
        """A new row's state under `policy`, on a model whose positions behave as `positions` says."""
        return cls(policy.budget or 0, policy.sinks, policy.original_positions(positions))
