"""What rows of one storage kind are and what the graphs may do with them: the typed spec a capacity
class carries (`CapacityClass.spec`), made in one place (`KVLayout.storage`), so that the worker and
speculative decoding ask it rather than compare storage-kind strings."""

from __future__ import annotations

from dataclasses import dataclass

from contract.cache_policy import INT8, INT8_CHANNEL


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
