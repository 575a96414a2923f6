"""Model sizes by name: the one registry that training presets and the serving sizes share.

`tiny` is the trained, shipped family. `small` is GPT-2 small's shape (12 x 768, 12 heads, about
85 M parameters with the byte vocabulary): served with random weights from a fixed seed by
`python -m export --size small`, to measure latency, memory and capacity at a width a user would
deploy (quality needs trained weights; those do not). `mini`, `base` and `large` are training
presets only. Every size keeps the 256-byte training context, and the hybrids their 64-token
window with one global layer in four (ModelConfig's defaults).
"""

from __future__ import annotations

import torch

from models.config import ModelConfig
from models.transformer import Transformer

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 128, "n_layers": 4, "n_heads": 4},  # 0.83 M parameters, the shipped weights
    "mini": {"d_model": 256, "n_layers": 6, "n_heads": 8},  # 4.8 M
    "base": {"d_model": 384, "n_layers": 8, "n_heads": 6},  # 14.3 M
    "large": {"d_model": 512, "n_layers": 12, "n_heads": 8},  # 38 M
    "small": {"d_model": 768, "n_layers": 12, "n_heads": 12},  # 85 M: GPT-2 small's shape
}
# The sizes served with random weights (no training run behind them), and the seed they are drawn with.
RANDOM_SIZES = ("small",)
RANDOM_SEED = 1234
# The schemes a random size is exported and benchmarked for by default.
RANDOM_SCHEMES = ("rope", "alibi", "relative", "rnope-swa", "rope-swa", "mla")


def size_config(scheme: str, size: str, **overrides: int) -> ModelConfig:
    """The config of `scheme` at a named size; `overrides` replace dimensions (e.g. n_layers=2: a
    stand-in of the same width for tests, whose last layer is a hybrid's global one when it has
    fewer layers than a hybrid's period, so that it still has one)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    shape = SIZES[size] | overrides
    if shape["n_layers"] < ModelConfig.global_every:
        shape["global_every"] = shape["n_layers"]
    return ModelConfig(scheme=scheme, **shape)


def random_model(scheme: str, size: str, **overrides: int) -> Transformer:
    """`scheme` at a named size with random weights drawn from RANDOM_SEED: the same weights every
    time, so two exports (and two machines) serve the same model."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(RANDOM_SEED)
    try:
        return Transformer(size_config(scheme, size, **overrides)).eval()
    finally:
        torch.random.set_rng_state(generator_state)
