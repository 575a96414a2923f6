"""What one token's K/V cache is made of, and the storage kinds a row can have."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from contract.cache_policy import INT8, INT8_CHANNEL, CachePolicy
from contract.manifest import DTYPE_BYTES, INT8_SCALE_BYTES

# The storage kinds (contract.cache_policy): float rows' kind is the layout's dtype; INT8 rows hold int8
# values with per-token scales, INT8_CHANNEL rows int8 values with the model's fixed per-channel scales.
__all__ = ["INT8", "INT8_CHANNEL", "KVLayout"]


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

    def kind_of(self, policy: CachePolicy) -> str:
        """The storage kind of a row under a cache policy, on this model (CachePolicy.kind: INT8_CHANNEL
        only where the model has the channel scales its fused int8 graph reads)."""
        return policy.kind(self.dtype, self.channel_scales is not None)
