"""What one token's K/V cache is made of, and the storage kinds a row can have."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from contract.manifest import DTYPE_BYTES, INT8_SCALE_BYTES

INT8 = "int8"  # the storage kind of int8 rows with per-token scales (float rows' kind is the layout's dtype)
INT8_CHANNEL = "int8-channel"  # int8 rows with the model's fixed per-channel scales (contract/kv_int8.py)


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's cache: K and V of every layer and head."""

    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str  # float32 | float16
    # The fixed per-channel scales of INT8_CHANNEL rows, (2 x layers, heads, 1, head_dim) float32, or
    # None: the model's export has no graph that reads them, and unbounded int8 rows are INT8 rows.
    channel_scales: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def tensors(self) -> int:
        return 2 * self.n_layers

    @property
    def token_bytes(self) -> int:
        return self.tensors * self.n_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def kind_token_bytes(self, kind: str) -> int:
        """One token's bytes in rows of a storage kind (INT8: int8 values plus a float32 scale per head;
        INT8_CHANNEL: int8 values, the scales being the model's)."""
        if kind == INT8:
            return self.tensors * self.n_heads * (self.head_dim + INT8_SCALE_BYTES)
        if kind == INT8_CHANNEL:
            return self.tensors * self.n_heads * self.head_dim
        return self.token_bytes

    def int8_kind(self, bounded: bool) -> str:
        """The storage kind of an int8 row: INT8_CHANNEL for an unbounded row where the model has its
        graph (read inside the attention kernel), INT8 otherwise (bounded rows shift and re-index in
        place, which only the explicit graph does)."""
        return INT8_CHANNEL if self.channel_scales is not None and not bounded else INT8
