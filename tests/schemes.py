"""The trained schemes a test's subject applies to (the repository fixture exports every trained one)."""

from __future__ import annotations

from export.manifest import layer_cache_spec
from models.checkpoints import trained_schemes
from models.config import ModelConfig


def trained_key_value_schemes() -> list[str]:
    """The trained schemes that cache a K and a V a layer: the serving contract's key/value names, the
    fused GroupQueryAttention graphs and onnxruntime-genai are theirs (latent attention caches neither)."""
    return [s for s in trained_schemes() if layer_cache_spec(ModelConfig(scheme=s)).key_value]
