"""Rotary variants as a registry of pure functions with one signature (transformers'
modeling_rope_utils): each returns (inv_freq, attention_factor) for a head; `rope_inverse_frequencies`
picks one and handles partial rotary. models.positional applies them."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from models.config import RopeScaling


def _rope_default(head_dim: int, base: float, scaling: RopeScaling | None) -> tuple[Tensor, float]:
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim), 1.0


def _rope_linear(head_dim: int, base: float, scaling: RopeScaling | None) -> tuple[Tensor, float]:
    """Position interpolation: positions divided by the factor (Chen et al. 2023)."""
    assert scaling is not None
    inv_freq, _ = _rope_default(head_dim, base, None)
    return inv_freq / scaling.factor, 1.0


def _rope_ntk(head_dim: int, base: float, scaling: RopeScaling | None) -> tuple[Tensor, float]:
    """Static NTK-aware scaling: one fixed, larger base, base * factor^(d / (d - 2)), so low
    frequencies interpolate by about the factor and high ones barely move. Static: it applies at
    every length, short prompts included. Not Hugging Face's `dynamic` rope type, which leaves the
    base alone up to the training context and recomputes it from each sequence's length beyond."""
    assert scaling is not None
    new_base = base * scaling.factor ** (head_dim / (head_dim - 2))
    return _rope_default(head_dim, new_base, None)[0], 1.0


def _rope_yarn(head_dim: int, base: float, scaling: RopeScaling | None) -> tuple[Tensor, float]:
    """YaRN: interpolate only the dimensions whose wavelength exceeds the training context,
    ramping between beta_fast=32 and beta_slow=1 rotations, with attention temperature
    0.1 ln(s) + 1 (Peng et al. 2023, https://arxiv.org/abs/2309.00071)."""
    assert scaling is not None
    factor, original = scaling.factor, scaling.original_max_positions

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(32.0)), 0)
    high = min(math.ceil(correction_dim(1.0)), head_dim - 1)
    if low == high:
        high += 1  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation, _ = _rope_default(head_dim, base, None)
    interpolation = extrapolation / factor
    keep = 1.0 - ramp  # 1 = keep the original (high-frequency) dimension
    inv_freq = interpolation * (1.0 - keep) + extrapolation * keep
    return inv_freq, 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


ROPE_INIT_FUNCTIONS: dict[str, Callable[[int, float, RopeScaling | None], tuple[Tensor, float]]] = {
    "default": _rope_default,
    "linear": _rope_linear,
    "ntk": _rope_ntk,
    "yarn": _rope_yarn,
}


def rope_inverse_frequencies(
    head_dim: int, base: float = 10000.0, scaling: RopeScaling | None = None, rotary_dims: int | None = None
) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2], attention_factor) for the chosen rotary variant.

    Partial rotary (`rotary_dims` < head_dim, GPT-NeoX's rotary_pct, transformers'
    partial_rotary_factor): the variant's frequencies are those of a `rotary_dims`-wide head and
    the remaining pairs get frequency 0, i.e. they pass through unrotated. In the rotate-half
    layout that is NeoX's partial rotary up to a fixed permutation of the head's dimensions.
    """
    kind = "default" if scaling is None else scaling.kind
    dims = head_dim if rotary_dims is None else rotary_dims
    if dims % 2 or not 0 < dims <= head_dim:
        raise ValueError(f"rotary_dims must be even and within 2..{head_dim}, got {dims}")
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](dims, base, scaling)
    unrotated = torch.zeros((head_dim - dims) // 2, dtype=inv_freq.dtype)
    return torch.cat((inv_freq, unrotated)), attention_factor
