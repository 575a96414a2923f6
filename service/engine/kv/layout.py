"""What one token's K/V cache is made of, and the storage kinds a row can have."""

from __future__ import annotations

from dataclasses import dataclass

from contract.manifest import DTYPE_BYTES, INT8_SCALE_BYTES

INT8 = "int8"  # the storage kind of int8 rows (float rows' kind is the layout's dtype)


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's cache: K and V of every layer and head."""

    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str  # float32 | float16

    @property
    def tensors(self) -> int:
        return 2 * self.n_layers

    @property
    def token_bytes(self) -> int:
        return self.tensors * self.n_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def kind_token_bytes(self, kind: str) -> int:
        """One token's bytes in rows of a storage kind (INT8: int8 values plus a float32 scale per head)."""
        if kind == INT8:
            return self.tensors * self.n_heads * (self.head_dim + INT8_SCALE_BYTES)
        return self.token_bytes
