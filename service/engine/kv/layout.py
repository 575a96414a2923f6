"""What one token's K/V cache is made of, and the storage kinds a row can have."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from contract.cache_policy import INT8, INT8_CHANNEL, CachePolicy
from contract.kv_spec import KEY_VALUE
from contract.manifest import DTYPE_BYTES, INT8_SCALE_BYTES, CacheEviction
from service.engine.kv.spec import RowEviction, StorageSpec

# The storage kinds (contract.cache_policy): float rows' kind is the layout's dtype; INT8 rows hold int8
# values with per-token scales, INT8_CHANNEL rows int8 values with the model's fixed per-channel scales.
__all__ = ["INT8", "INT8_CHANNEL", "KVLayout"]


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's cache: each layer's `entries` (K and V of every head; latent attention:
    one [latent; rotated key] of one shared head, contract.kv_spec), `n_heads` x `head_dim` each.

    A hybrid model served with per-group caches (`local_layers` non-empty) keeps its local layers'
    K/V apart: a row holds the global layers' K/V of every token (`tensors`, `token_bytes`) and a
    fixed number of columns of the local layers' K/V (`local_columns`: `local_width`, or the row's
    capacity where that is less), since a local layer never attends further back than its `window`."""

    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str  # float32 | float16
    # The fixed per-channel scales of INT8_CHANNEL rows, (2 x layers, heads, 1, head_dim) float32, or
    # None: the model's export has no graph that reads them, and unbounded int8 rows are INT8 rows.
    channel_scales: np.ndarray | None = field(default=None, compare=False, repr=False)
    local_layers: tuple[int, ...] = ()  # layers whose K/V live in the row's local columns
    window: int = 0  # the tokens a local layer attends to, its query's own included
    local_width: int = 0  # the local columns of a row: the window, slack for shifts, guesses, a block
    entries: tuple[str, ...] = KEY_VALUE  # what a layer caches per token (graph name suffixes)
    # The columns of a layer's first entry that carry a rotation (None: all of them, RoPE's keys;
    # latent attention: its rotated key's, after the latent).
    rotated_columns: tuple[int, int] | None = None
    # Where positions go once a bounded policy evicts (the manifest's `cache_eviction`; None: the
    # scheme serves no bounded policy).
    positions: CacheEviction | None = field(default=None, compare=False)

    @property
    def per_layer(self) -> int:
        """Cache tensors a layer keeps per token (2: K and V; 1: latent attention's one entry)."""
        return len(self.entries)

    @property
    def split(self) -> bool:
        """The local layers' K/V are kept apart, bounded by the window."""
        return bool(self.local_layers)

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers whose K/V grow with the sequence (every layer when not split)."""
        return tuple(layer for layer in range(self.n_layers) if layer not in self.local_layers)

    @property
    def tensors(self) -> int:
        """K/V tensors per token of the row's main array (the global layers')."""
        return self.per_layer * len(self.global_layers)

    @property
    def local_tensors(self) -> int:
        return self.per_layer * len(self.local_layers)

    @property
    def token_bytes(self) -> int:
        return self.tensors * self.n_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def local_token_bytes(self) -> int:
        """One token's K/V in the local layers (0 when not split)."""
        return self.local_tensors * self.n_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def local_row_bytes(self) -> int:
        """The local columns of a row of a class at least `local_width` wide (0 when not split)."""
        return self.local_width * self.local_token_bytes

    @property
    def repair_tokens(self) -> int:
        """Tokens one prompt call recomputes, after the global K/V of a prefix-cache hit, to rebuild the
        local layers' window before it when the cache kept none there: a layer's K/V at a token are exact
        once its input is, and each local layer reaches `window - 1` tokens further back, so with every
        local layer below every global one (whose K/V the cache holds) the last window is exact after
        `local layers x (window - 1)` tokens. 0: not split, or a global layer below a local one (its
        output would need the call's own, inexact, global K/V)."""
        if not self.split or (self.global_layers and max(self.local_layers) > min(self.global_layers)):
            return 0
        return len(self.local_layers) * (self.window - 1)

    def local_columns(self, capacity: int) -> int:
        """The local columns of a row of `capacity` tokens: never more than the row's own tokens, so a
        short row never pays for the window's slack (0 when not split)."""
        return min(capacity, self.local_width)

    def row_bytes(self, capacity: int, kind: str) -> int:
        """One row of a class of `capacity` tokens and storage `kind`: its global columns and its local ones."""
        return capacity * self.kind_token_bytes(kind) + self.local_columns(capacity) * self.local_token_bytes

    def kind_token_bytes(self, kind: str) -> int:
        """One token's bytes in rows of a storage kind (INT8: int8 values plus a float32 scale per head;
        INT8_CHANNEL: int8 values, the scales being the model's)."""
        if kind == INT8:
            return self.tensors * self.n_heads * (self.head_dim + INT8_SCALE_BYTES)
        if kind == INT8_CHANNEL:
            return self.tensors * self.n_heads * self.head_dim
        return self.token_bytes

    def storage(self, kind: str) -> StorageSpec:
        """The typed spec of rows of a storage kind (what callers ask instead of comparing kinds)."""
        return StorageSpec(kind, self.kind_token_bytes(kind))

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
