"""Multi-head latent attention with decoupled RoPE (`mla`): DeepSeek-V2's way to shrink the cache.

Keys and values are up-projected from one small latent per token (width `config.latent_dim`), so a
token's cache is that latent plus one rotated key of width `config.latent_rope_dim` shared by every
head. RoPE cannot touch the up-projected keys: a rotation between the query and the key
up-projection would stop the up-projection being folded into the query at decode ("absorbed"
attention over the latent). So positions live only in a small decoupled part: each head's query has
a no-position part (dotted with the up-projected key) and a rotated part (dotted with the shared
rotated key). DeepSeek-V2, section 2.1: https://arxiv.org/abs/2405.04434.

The scheme's cache per layer is the pair (rotated keys (B, 1, T, d_R), latents (B, 1, T, d_c)):
the first element carries every position (what `move_keys` turns), the second none.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from models.config import ModelConfig
from models.positional import (
    PositionalScheme,
    QueryKeyRotation,
    RotaryRotation,
    apply_rope,
    register,
    rope_angles,
    rope_inverse_frequencies,
)

KeyValue = tuple[Tensor, Tensor]


def latent_rope_frequencies(config: ModelConfig) -> Tensor:
    """Inverse frequencies [d_R / 2] of the decoupled rotated part: RoPE on a d_R-wide head."""
    return rope_inverse_frequencies(config.latent_rope_width, config.rope_base, config.rope_scaling)[0]


@register
class LatentRotary(PositionalScheme):
    """MLA: positions only in the decoupled rotated query and key parts (width d_R)."""

    name = "mla"
    rotates_keys = True
    segment_reuse = "rotate"
    #: A window or sinks would evict latents; not built (full precision, no int8: the graph has none).
    bounded_policies = False

    def rotation(self, position_ids: Tensor) -> QueryKeyRotation:
        config = self.config
        cos, sin = rope_angles(position_ids, config.latent_rope_width, config.rope_base, config.rope_scaling)
        return RotaryRotation(cos.unsqueeze(1), sin.unsqueeze(1))  # (B, 1, T, d_R)

    def move_keys(self, keys: Tensor, offset: int) -> Tensor:
        """Rotated keys (..., T, d_R) as if computed `offset` positions later; latents never move."""
        freqs = offset * latent_rope_frequencies(self.config).to(keys.device, torch.float64)
        emb = torch.cat((freqs, freqs), dim=-1)
        return apply_rope(keys, torch.cos(emb).to(keys.dtype), torch.sin(emb).to(keys.dtype))

    def attention(self, config: ModelConfig) -> nn.Module:
        return LatentAttention(config)


class LatentAttention(nn.Module):
    """Attention whose cache is a latent and a shared rotated key per token.

    Two forms of the same mathematics:
    - up-projected (training, prompts): every cached latent up-projected to per-head keys and values;
    - absorbed (decode): the key up-projection folded into the query and the value up-projection
      applied after attention, so attention runs over the latents themselves, one shared KV head whose
      key is [latent; rotated key] (d_c + d_R wide) and whose value is the latent.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.latent_dim, self.rope_dim = config.latent_width, config.latent_rope_width
        self.query = nn.Linear(config.d_model, config.n_heads * (self.head_dim + self.rope_dim))
        self.kv_down = nn.Linear(config.d_model, self.latent_dim + self.rope_dim)
        self.latent_norm = nn.LayerNorm(self.latent_dim, eps=config.layer_norm_eps)
        self.key_up = nn.Linear(self.latent_dim, config.d_model, bias=False)
        self.value_up = nn.Linear(self.latent_dim, config.d_model, bias=False)
        self.out_proj = nn.Linear(config.d_model, config.d_model)
        self.scale = 1.0 / math.sqrt(self.head_dim + self.rope_dim)
        self.absorbed, self.fused = False, False

    def empty_past(self, batch: int, dtype: torch.dtype, device: torch.device) -> KeyValue:
        return (
            torch.zeros((batch, 1, 0, self.rope_dim), dtype=dtype, device=device),
            torch.zeros((batch, 1, 0, self.latent_dim), dtype=dtype, device=device),
        )

    def serve_in_place(self) -> None:
        """Serving layout: attend over the cached latents in absorbed form, return only new entries."""
        self.absorbed = True

    def use_fused_kernel(self) -> None:
        self.fused = True

    def forward(
        self, x: Tensor, score_bias: Tensor, rotation: QueryKeyRotation, past: KeyValue
    ) -> tuple[Tensor, KeyValue]:
        batch, seq, width = x.shape
        q = self.query(x).view(batch, seq, self.n_heads, self.head_dim + self.rope_dim).transpose(1, 2)
        q_plain, q_rotated = q.split((self.head_dim, self.rope_dim), dim=-1)  # (B, nh, T, hs), (B, nh, T, d_R)
        latent, rotated_key = self.kv_down(x).split((self.latent_dim, self.rope_dim), dim=-1)
        latent = self.latent_norm(latent).unsqueeze(1)  # (B, 1, T, d_c)
        q_rotated, rotated_key = rotation(q_rotated, rotated_key.unsqueeze(1))  # rotated_key (B, 1, T, d_R)
        if self.absorbed:
            y = self._attend_absorbed(q_plain, q_rotated, past, rotated_key, latent, score_bias)
            present = (rotated_key, latent)
        else:
            present = (torch.cat((past[0], rotated_key), dim=2), torch.cat((past[1], latent), dim=2))
            y = self._attend_up_projected(q_plain, q_rotated, *present, score_bias)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, width)), present

    def _heads(self, projection: nn.Linear, latents: Tensor) -> Tensor:
        """Latents (B, 1, T, d_c) up-projected to (B, nh, T, hs)."""
        batch, _, length, _ = latents.shape
        return projection(latents[:, 0]).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)

    def _attend_up_projected(
        self, q_plain: Tensor, q_rotated: Tensor, rotated_keys: Tensor, latents: Tensor, score_bias: Tensor
    ) -> Tensor:
        keys = torch.cat((self._heads(self.key_up, latents), rotated_keys.expand(-1, self.n_heads, -1, -1)), -1)
        values = self._heads(self.value_up, latents)
        query = torch.cat((q_plain, q_rotated), dim=-1)
        if self.fused:
            return F.scaled_dot_product_attention(
                query, keys, values, attn_mask=score_bias.to(query.dtype), scale=self.scale
            )
        weights = torch.softmax((query @ keys.transpose(-2, -1)) * self.scale + score_bias, dim=-1)
        return weights @ values

    def absorbed_query(self, q_plain: Tensor) -> Tensor:
        """Each head's no-position query folded through its key up-projection: (B, nh, T, d_c)."""
        w_uk = self.key_up.weight.view(self.n_heads, self.head_dim, self.latent_dim)  # (nh, hs, d_c)
        return q_plain @ w_uk

    def _attend_absorbed(
        self,
        q_plain: Tensor,
        q_rotated: Tensor,
        past: KeyValue,
        rotated_key: Tensor,
        latent: Tensor,
        score_bias: Tensor,
    ) -> Tensor:
        """Scores against the cache and the new tokens apart (the cache is read, never copied)."""
        query = torch.cat((self.absorbed_query(q_plain), q_rotated), dim=-1)  # (B, nh, T, d_c + d_R)
        past_keys = torch.cat((past[1], past[0]), dim=-1)  # (B, 1, P, d_c + d_R)
        new_keys = torch.cat((latent, rotated_key), dim=-1)
        scores = torch.cat((query @ past_keys.transpose(-2, -1), query @ new_keys.transpose(-2, -1)), dim=-1)
        weights = torch.softmax(scores * self.scale + score_bias, dim=-1)
        past_len = past[1].shape[2]
        mixed = weights[..., :past_len] @ past[1] + weights[..., past_len:] @ latent  # (B, nh, T, d_c)
        w_uv = self.value_up.weight.view(self.n_heads, self.head_dim, self.latent_dim)  # (nh, hs, d_c)
        return mixed @ w_uv.transpose(-2, -1)  # (B, nh, T, hs)
