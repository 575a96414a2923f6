"""What rows of one storage kind are and what the graphs may do with them (`StorageSpec`, the typed spec a
capacity class carries as `CapacityClass.spec`), and what a row's cache policy keeps and where its
positions go once it evicts (`RowEviction`): both made in one place, the layout (`KVLayout.storage`,
`KVLayout.row_eviction`), from the model's manifest and the request's CachePolicy, so that the worker
and speculative decoding ask them rather than compare storage-kind strings or translate policies."""

from __future__ import annotations

from dataclasses import dataclass

from contract.cache_policy import INT8, INT8_CHANNEL, CachePolicy
from contract.manifest import CacheEviction
from service.engine.kv.arrays import Array


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
        return self.kind == "float32"


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
