"""What one layer caches per token: the typed spec a model's manifest declares (key `kv_cache`) and
export, the runtimes and the service read, so none of them asks which attention a scheme uses.

- full attention (every classic scheme, and both groups of a hybrid): a key and a value per token, each
  `heads` x `width` (the head dim); a rotated scheme's key carries its position in every column;
- latent attention (`mla`, DeepSeek-V2): one entry per token, [latent; rotated key], one shared head
  `latent_width + rope_width` wide; only its last `rope_width` columns carry a position.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
LATENT_ATTENTION = "latent_attention"
KEY_VALUE = ("key", "value")
LATENT = ("latent",)


@dataclass(frozen=True)
class LayerCacheSpec:
    """One layer's cache per token: `entries` tensors (graph name suffixes), each `heads` x `width`; the
    first entry is the one a rotation turns, in its columns `rotated_columns` [start, stop)."""

    kind: str
    entries: tuple[str, ...]
    heads: int
    width: int
    rotated_columns: tuple[int, int]

    @classmethod
    def full(cls, heads: int, head_dim: int) -> LayerCacheSpec:
        return cls(FULL_ATTENTION, KEY_VALUE, heads, head_dim, (0, head_dim))

    @classmethod
    def latent(cls, latent_width: int, rope_width: int) -> LayerCacheSpec:
        return cls(LATENT_ATTENTION, LATENT, 1, latent_width + rope_width, (latent_width, latent_width + rope_width))

    @property
    def per_layer(self) -> int:
        """Tensors a layer caches per token (2: K and V; 1: latent attention's one entry)."""
        return len(self.entries)

    @property
    def token_floats(self) -> int:
        """Numbers one layer caches per token."""
        return self.per_layer * self.heads * self.width

    @property
    def key_value(self) -> bool:
        """A K and a V of every head: what the int8 and fused (GroupQueryAttention) graphs are built for."""
        return self.kind == FULL_ATTENTION

    def rotated_rows(self, layers: tuple[int, ...] | range) -> list[int]:
        """Indices of these layers' rotated entries in an array of (per_layer x layers, ...) entries."""
        return [self.per_layer * index for index, _ in enumerate(layers)]

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "entries": list(self.entries),
            "heads": self.heads,
            "width": self.width,
            "rotated_columns": list(self.rotated_columns),
        }

    @classmethod
    def from_json(cls, raw: dict[str, object]) -> LayerCacheSpec:
        start, stop = raw["rotated_columns"]  # type: ignore[misc]
        entries = tuple(str(entry) for entry in raw["entries"])  # type: ignore[attr-defined]
        return cls(str(raw["kind"]), entries, int(raw["heads"]), int(raw["width"]), (int(start), int(stop)))  # type: ignore[arg-type]
