"""Model configuration: one dataclass shared by training, export and evaluation.

It knows nothing of the positional schemes' classes: the scheme registry in `models.positional`
is the one list of schemes, and validates `scheme` when the model is built.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from models.tokenizer import TOKENIZER


@dataclass
class RopeScaling:
    """Inference-time rotary scaling; `factor` = target context / training context."""

    kind: str  # "linear" | "ntk" (static NTK-aware: a fixed base, not HF's "dynamic") | "yarn"
    factor: float
    original_max_positions: int = 256

    @classmethod
    def parse(cls, text: str, original_max_positions: int = 256) -> RopeScaling:
        """Parse `kind:factor`, e.g. `ntk:4`."""
        kind, _, factor = text.partition(":")
        if kind not in ("linear", "ntk", "yarn") or not factor:
            raise ValueError(f"rope scaling must look like linear:4, ntk:4 or yarn:4, got {text!r}")
        return cls(kind, float(factor), original_max_positions)


@dataclass
class ModelConfig:
    scheme: str = "none"  # a name in models.positional.SCHEMES
    vocab_size: int = TOKENIZER.vocab_size
    n_layers: int = 4
    n_heads: int = 4
    d_model: int = 128
    # None = 4 * d_model; `matched` shrinks it so every scheme has the same parameter count.
    d_ff: int | None = None
    train_context: int = 256
    # Hard limit of the `learned` table; other schemes have none (None = unbounded).
    max_positions: int | None = None
    # T5 defaults: 32 causal buckets, logarithmic beyond half of them, saturating at 128.
    relative_num_buckets: int = 32
    relative_max_distance: int = 128
    rope_base: float = 10000.0
    # Rotated dimensions of each head (None = all); the rest pass through (GPT-NeoX's partial rotary).
    rope_rotary_dims: int | None = None
    rope_scaling: RopeScaling | None = None
    # Hybrid local/global schemes (rnope-swa, rope-swa): each local layer sees only the last
    # `sliding_window` tokens (itself included); every `global_every`-th layer sees everything
    # (3 local : 1 global, as Command R7B and Llama 4's iRoPE).
    sliding_window: int = 64
    global_every: int = 4
    # Latent attention (mla): the cached latent's width (None = d_model / 2) and the decoupled
    # rotated key's, shared by every head (None = head_dim / 2). 64 + 16 per layer at 4 x 128.
    latent_dim: int | None = None
    latent_rope_dim: int | None = None
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.scheme == "learned" and self.max_positions is None:
            self.max_positions = self.train_context
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def latent_width(self) -> int:
        return self.d_model // 2 if self.latent_dim is None else self.latent_dim

    @property
    def latent_rope_width(self) -> int:
        return self.head_dim // 2 if self.latent_rope_dim is None else self.latent_rope_dim

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> ModelConfig:
        return cls(**json.loads(path.read_text()))
