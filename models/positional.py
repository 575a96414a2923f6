"""Positional schemes: pure functions plus one small module per scheme behind one interface.

The pure functions are public (tools and tests depend on their names) and accept numpy arrays
or torch tensors, returning the same kind. The modules turn them into what a forward pass
needs, computed once per forward and only *applied* inside attention:

- an additive input embedding (sinusoidal, learned),
- an additive attention-logit bias (relative, alibi),
- a rotation of queries and keys (rope),
- or nothing at all (none / NoPE: the causal mask is the only source of order).

Latent attention (mla) is a rotation too, on a small decoupled part of each query and one shared key;
it brings its own attention layer (models/latent.py), since what it caches is not a K and a V.

A hybrid scheme (rnope-swa, rope-swa) splits the layers into groups (`LayerGroup`): local layers
that attend within a sliding window with one unit, global layers that attend to everything with
another. Every other scheme is one global group of all layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from models.config import ModelConfig, RopeScaling
from models.latent import LatentAttention
from models.limits import check_positions
from models.rope_scaling import rope_inverse_frequencies

ArrayT = TypeVar("ArrayT", np.ndarray, Tensor)


def _to_torch(x: np.ndarray | Tensor) -> Tensor:
    return x if isinstance(x, Tensor) else torch.from_numpy(np.asarray(x))


def _like(result: Tensor, original: np.ndarray | Tensor) -> np.ndarray | Tensor:
    return result if isinstance(original, Tensor) else result.numpy()


# ----------------------------------------------------------------------------- pure functions


def sinusoid(positions: Tensor, dim: int) -> Tensor:
    """Sinusoidal code for any positions tensor [...] -> [..., dim] (float32).

    PE(pos, 2i) = sin(pos / 10000^(2i/dim)), PE(pos, 2i+1) = cos(same angle)
    (Vaswani et al. 2017, section 3.5: https://arxiv.org/abs/1706.03762).
    """
    even = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = torch.pow(10000.0, -even / dim)  # (dim/2,)
    angle = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (..., dim/2)
    return torch.stack((torch.sin(angle), torch.cos(angle)), dim=-1).flatten(-2)  # interleave


def sinusoidal_table(n_positions: int, dim: int) -> np.ndarray:
    """The [n_positions, dim] sinusoidal table; row 0 alternates 0, 1."""
    return sinusoid(torch.arange(n_positions), dim).numpy()


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi head slopes [n_heads]: the geometric sequence 2^(-8/n), 2^(-16/n), ...

    For head counts that are not a power of two the paper takes the slopes of the closest
    power of two below and fills up with every other slope of twice that count
    (Press et al. 2022, section 3: https://arxiv.org/abs/2108.12409).
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two(closest)
    if closest < n_heads:
        slopes += power_of_two(2 * closest)[0::2][: n_heads - closest]
    return np.asarray(slopes, dtype=np.float32)


def relative_position_bucket(
    relative_position: ArrayT,
    bidirectional: bool = False,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> ArrayT:
    """T5's bucket of `relative_position` = key position - query position.

    Half the buckets hold exact small distances, the rest grow logarithmically up to
    `max_distance`, beyond which everything shares the last bucket. With
    `bidirectional=False` (causal) only keys at or before the query are distinguished.
    Mirrors `T5Attention._relative_position_bucket` (Raffel et al. 2020).
    """
    rel = _to_torch(relative_position).to(torch.int64)
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).to(torch.int64) * num_buckets
        distance = rel.abs()
    else:
        distance = torch.clamp(-rel, min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # clamp(min=1) only avoids log(0) in the branch that `where` discards anyway.
    log_ratio = torch.log(torch.clamp(distance, min=1).to(torch.float32) / max_exact)
    large = max_exact + (log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)).to(torch.int64)
    large = torch.clamp(large, max=num_buckets - 1)
    return _like(buckets + torch.where(is_small, distance, large), relative_position)  # type: ignore[return-value]


def rope_angles(
    positions: ArrayT,
    head_dim: int,
    base: float = 10000.0,
    scaling: RopeScaling | None = None,
    rotary_dims: int | None = None,
) -> tuple[ArrayT, ArrayT]:
    """Rotary (cos, sin), each [*positions.shape, head_dim], in the rotate-half layout.

    (Su et al. 2021, https://arxiv.org/abs/2104.09864; layout as in Llama/transformers.)
    """
    inv_freq, attention_factor = rope_inverse_frequencies(head_dim, base, scaling, rotary_dims)
    # Angles in float64: a float32 product strays from position x inv_freq in proportion to the
    # position, so a key rotated at p would differ from one rotated at 0 and moved by p (`move_keys`).
    pos = _to_torch(positions).to(torch.float64)
    freqs = pos.unsqueeze(-1) * inv_freq.to(pos.device, torch.float64)  # (..., head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., head_dim)
    cos = (torch.cos(emb) * attention_factor).to(torch.float32)
    sin = (torch.sin(emb) * attention_factor).to(torch.float32)
    return _like(cos, positions), _like(sin, positions)  # type: ignore[return-value]


def rope_rotation_frequencies(config: ModelConfig) -> Tensor:
    """The inverse frequencies [head_dim/2] (float32) of the config's rotary variant, without the
    attention factor: what moving a cached key needs (`RotaryPositions.move_keys`). The export
    writes them into the manifest so the service can move sink keys the same way in numpy."""
    inv_freq, _ = rope_inverse_frequencies(
        config.head_dim, config.rope_base, config.rope_scaling, config.rope_rotary_dims
    )
    return inv_freq


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: ArrayT, cos: ArrayT, sin: ArrayT) -> ArrayT:
    """Rotate x [..., seq, head_dim] by the angles of `rope_angles` ([seq, head_dim] or broadcastable)."""
    xt, c, s = _to_torch(x), _to_torch(cos), _to_torch(sin)
    return _like(xt * c + _rotate_half(xt) * s, x)  # type: ignore[return-value]


# ----------------------------------------------------------------------------- scheme modules


class QueryKeyRotation:
    """What attention applies to q and k; the identity unless the scheme rotates."""

    def __call__(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k


class RotaryRotation(QueryKeyRotation):
    def __init__(self, cos: Tensor, sin: Tensor) -> None:
        self.cos, self.sin = cos, sin  # (B, 1, T, hs)

    def __call__(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos.to(q.dtype), self.sin.to(q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class PositionalScheme(nn.Module):
    """The one interface. The model asks each hook once per forward pass.

    Positions are absolute token indices within a sequence (left padding excluded), so
    cached decoding and left-padded batches see the same positions as a lone sequence.
    """

    name: ClassVar[str]
    #: Positions at or beyond this cannot be represented (None = unbounded).
    max_positions: int | None = None
    #: Positions once a bounded cache policy has evicted tokens (contract/cache_policy.py):
    #: "cache" = distances within the cache (StreamingLLM re-indexing: bias schemes and none via
    #: position ids, rope via `move_keys`); "original" = absolute schemes, whose positions are
    #: baked into cached keys and cannot be taken out.
    eviction_positions: ClassVar[str] = "cache"
    #: Whether bounded cache policies (window, sinks) apply. A hybrid's local layers are bounded by
    #: their window already; evicting from its global layer alone is not built (full and int8 only).
    bounded_policies: ClassVar[bool] = True
    #: True when cached keys carry their position (rope), so re-indexing them means `move_keys`.
    rotates_keys: ClassVar[bool] = False
    #: What K/V computed for a text on its own, from position 0, needs to serve that text at another
    #: offset (a document reused behind any prefix): "as_is" = nothing, keys carry no position
    #: (bias schemes, none: the bias is applied where the key lands); "rotate" = its keys turned by
    #: the offset (`move_keys`); "recompute" = impossible, the positions entered every layer's input.
    segment_reuse: ClassVar[str] = "as_is"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def input_embedding(self, position_ids: Tensor) -> Tensor | None:
        """Added to the token embeddings: (B, T) -> (B, T, d) or None."""
        return None

    def attention_bias(self, query_positions: Tensor, key_positions: Tensor) -> Tensor | None:
        """Added to attention logits: (B, Tq), (B, Tk) -> (B, H, Tq, Tk) or None."""
        return None

    def rotation(self, position_ids: Tensor) -> QueryKeyRotation:
        """Applied to q and k of the new tokens before they enter the cache."""
        return QueryKeyRotation()

    def move_keys(self, keys: Tensor, offset: int) -> Tensor:
        """Keys already cached, (..., T, head_dim), as if they had been computed `offset`
        positions later. Only rotated keys carry a position; every other scheme keeps none in
        its keys (or, for absolute schemes, one that cannot be taken out), so: the identity."""
        return keys

    def attention(self, config: ModelConfig) -> nn.Module | None:
        """The attention layer this scheme needs; None = standard multi-head attention (`mla` has its own)."""
        return None

    def key_frequencies(self) -> Tensor:
        """The inverse frequencies `move_keys` turns cached keys with (RoPE's on the whole head)."""
        return rope_rotation_frequencies(self.config)

    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The layers that attend alike, each group with its unit and window. One global group of
        every layer, unless the scheme is a hybrid."""
        return (LayerGroup("global", tuple(range(self.config.n_layers)), self, None),)


@dataclass(frozen=True)
class LayerGroup:
    """Layers that attend alike: the positional unit they apply and how far back they see.

    `window` None: the whole past (a global layer); else the last `window` tokens, the query
    itself included (a sliding-window layer, whose cache never needs more than `window` keys).
    """

    name: str  # "global" | "local"
    layers: tuple[int, ...]
    positional: PositionalScheme
    window: int | None = None


# The one list of schemes: name -> module. Registration order is the order every list shows.
SCHEME_REGISTRY: dict[str, type[PositionalScheme]] = {}


def register(cls: type[PositionalScheme]) -> type[PositionalScheme]:
    SCHEME_REGISTRY[cls.name] = cls
    return cls


def build_positional(config: ModelConfig) -> PositionalScheme:
    """The scheme's module; the scheme name is validated here, where the registry lives."""
    if config.scheme not in SCHEME_REGISTRY:
        raise ValueError(f"scheme must be one of {', '.join(SCHEME_REGISTRY)}, got {config.scheme!r}")
    return SCHEME_REGISTRY[config.scheme](config)


@register
class SinusoidalPositions(PositionalScheme):
    """Fixed sinusoids added to the input; computed from positions, so no length limit."""

    name = "sinusoidal"
    eviction_positions = "original"
    segment_reuse = "recompute"

    def input_embedding(self, position_ids: Tensor) -> Tensor:
        # Vaswani et al. multiply token embeddings by sqrt(d_model) before adding the code;
        # dividing the code instead keeps that ratio without touching the shared (tied)
        # embedding. Unscaled, the code is ~30x the 0.02-initialised embeddings and drowns them.
        return sinusoid(position_ids, self.config.d_model) / math.sqrt(self.config.d_model)


@register
class LearnedPositions(PositionalScheme):
    """A trained absolute table (GPT-2 style) with a hard `max_positions`."""

    name = "learned"
    eviction_positions = "original"
    segment_reuse = "recompute"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.max_positions is not None
        self.max_positions = config.max_positions
        self.table = nn.Embedding(config.max_positions, config.d_model)

    def input_embedding(self, position_ids: Tensor) -> Tensor:
        if not torch.compiler.is_compiling():
            check_positions(position_ids, self.max_positions)
        return self.table(position_ids)


@register
class RelativeBias(PositionalScheme):
    """T5-style learned scalar bias per (bucketed distance, head), shared by all layers."""

    name = "relative"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.bias = nn.Embedding(config.relative_num_buckets, config.n_heads)

    def attention_bias(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        relative = key_positions[:, None, :] - query_positions[:, :, None]  # (B, Tq, Tk)
        buckets = relative_position_bucket(
            relative,
            bidirectional=False,
            num_buckets=self.config.relative_num_buckets,
            max_distance=self.config.relative_max_distance,
        )
        return self.bias(buckets).permute(0, 3, 1, 2)  # (B, H, Tq, Tk)


@register
class RotaryPositions(PositionalScheme):
    """RoPE on q and k; `config.rope_scaling` selects linear / ntk / yarn at inference."""

    name = "rope"
    rotates_keys = True
    segment_reuse = "rotate"

    def rotation(self, position_ids: Tensor) -> QueryKeyRotation:
        config = self.config
        cos, sin = rope_angles(
            position_ids, config.head_dim, config.rope_base, config.rope_scaling, config.rope_rotary_dims
        )
        return RotaryRotation(cos.unsqueeze(1), sin.unsqueeze(1))  # (B, 1, T, hs)

    def move_keys(self, keys: Tensor, offset: int) -> Tensor:
        """A pure rotation by offset * inv_freq. Scores depend only on q and k position
        differences, so a key moved from i to i + offset equals one rotated at i + offset in the
        first place. No attention factor (YaRN): the cached keys already carry it once."""
        freqs = offset * rope_rotation_frequencies(self.config).to(keys.device, torch.float64)  # (head_dim/2,)
        emb = torch.cat((freqs, freqs), dim=-1)  # (head_dim,)
        return apply_rope(keys, torch.cos(emb).to(keys.dtype), torch.sin(emb).to(keys.dtype))


@register
class AlibiBias(PositionalScheme):
    """A fixed linear penalty on distance, one slope per head."""

    name = "alibi"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        slopes = torch.from_numpy(alibi_slopes(config.n_heads))
        self.register_buffer("slopes", slopes.view(1, -1, 1, 1), persistent=False)

    def attention_bias(self, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # (B, 1, Tq, Tk)
        return -self.slopes * distance.to(torch.float32)  # (B, H, Tq, Tk)


@register
class NoPositions(PositionalScheme):
    """NoPE: order comes only from the causal mask (Kazemnejad et al. 2023)."""

    name = "none"


class LocalGlobalHybrid(PositionalScheme):
    """Sliding-window RoPE layers with a global layer every `config.global_every` layers.

    Local layers rotate q and k and see the last `config.sliding_window` tokens; the global layer
    applies `global_unit` to everything. The pair of hybrids below differs only in that unit, which
    separates what the windows buy from what the global layer's encoding buys.
    """

    #: The global layer's unit: NoPE (Command R7B, Llama 4's iRoPE) or RoPE (Gemma 2 and 3).
    global_unit: ClassVar[type[PositionalScheme]]
    bounded_policies = False
    rotates_keys = True
    segment_reuse = "rotate"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.sliding_window < 1 or config.global_every < 1:
            raise ValueError(
                f"sliding_window and global_every must be positive, got {config.sliding_window}, {config.global_every}"
            )
        self.local = RotaryPositions(config)
        self.global_ = self.global_unit(config)

    def layer_groups(self) -> tuple[LayerGroup, ...]:
        every = self.config.global_every
        layers = range(self.config.n_layers)
        local = tuple(i for i in layers if (i + 1) % every)
        global_ = tuple(i for i in layers if not (i + 1) % every)
        groups = (
            LayerGroup("local", local, self.local, self.config.sliding_window),
            LayerGroup("global", global_, self.global_, None),
        )
        return tuple(group for group in groups if group.layers)


@register
class RopeWindowsNopeGlobal(LocalGlobalHybrid):
    """RNoPE-SWA: RoPE windows, a global layer without positions ("Rope to Nope and Back Again", 2025)."""

    name = "rnope-swa"
    global_unit = NoPositions


@register
class RopeWindowsRopeGlobal(LocalGlobalHybrid):
    """RoPE windows and a global RoPE layer (Gemma 2 and 3's pattern)."""

    name = "rope-swa"
    global_unit = RotaryPositions


def latent_rope_frequencies(config: ModelConfig) -> Tensor:
    """Inverse frequencies [d_R / 2] of latent attention's decoupled rotated part: RoPE on a d_R-wide head."""
    return rope_inverse_frequencies(config.latent_rope_width, config.rope_base, config.rope_scaling)[0]


@register
class LatentRotary(PositionalScheme):
    """MLA (models/latent.py): positions only in the decoupled rotated query and key parts (width d_R),
    so the cached latent carries none and the key up-projection folds into the query at decode."""

    name = "mla"
    rotates_keys = True
    segment_reuse = "rotate"
    #: A window or sinks would evict latents: not built; nor int8 (the latent cache has no int8 graph).
    bounded_policies = False

    def rotation(self, position_ids: Tensor) -> QueryKeyRotation:
        config = self.config
        cos, sin = rope_angles(position_ids, config.latent_rope_width, config.rope_base, config.rope_scaling)
        return RotaryRotation(cos.unsqueeze(1), sin.unsqueeze(1))  # (B, 1, T, d_R)

    def move_keys(self, keys: Tensor, offset: int) -> Tensor:
        """A layer's cache (..., T, d_c + d_R) as if computed `offset` positions later: its rotated
        keys (the last d_R columns) turned, its latents (which carry no position) as they were."""
        freqs = offset * latent_rope_frequencies(self.config).to(keys.device, torch.float64)
        emb = torch.cat((freqs, freqs), dim=-1)
        latent, rotated = keys.split((self.config.latent_width, self.config.latent_rope_width), dim=-1)
        moved = apply_rope(rotated, torch.cos(emb).to(keys.dtype), torch.sin(emb).to(keys.dtype))
        return torch.cat((latent, moved), dim=-1)

    def key_frequencies(self) -> Tensor:
        return latent_rope_frequencies(self.config)

    def attention(self, config: ModelConfig) -> nn.Module:
        return LatentAttention(config)


# Every list of schemes (CLI choices, export, load tests, tests) is this one, in registration order.
SCHEMES: tuple[str, ...] = tuple(SCHEME_REGISTRY)


def matched_config(scheme: str, **overrides: object) -> ModelConfig:
    """A config whose total parameter count matches the scheme-free model.

    A learned position table is ~4% of a model this small (and latent attention's projections
    differ from the standard attention's); to give every scheme the same budget we take those
    parameters out of the MLP hidden width (2 * d_model + 1 per unit
    per layer), the usual way parameter-matched ablations are built.
    """
    config = ModelConfig(scheme=scheme, **overrides)  # type: ignore[arg-type]
    positional = build_positional(config)
    extra = sum(p.numel() for p in positional.parameters())
    attention = positional.attention(config)
    if attention is not None:  # its own attention layer: count what it adds over the standard one
        standard = 4 * config.d_model * config.d_model + 4 * config.d_model
        extra += config.n_layers * (sum(p.numel() for p in attention.parameters()) - standard)
    per_unit = config.n_layers * (2 * config.d_model + 1)
    assert config.d_ff is not None
    config.d_ff -= round(extra / per_unit)
    return config
