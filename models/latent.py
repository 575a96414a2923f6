"""Multi-head latent attention with decoupled RoPE: the attention layer of the `mla` scheme
(models.positional.LatentRotary), DeepSeek-V2's way to shrink the cache.

Keys and values are up-projected from one small latent per token (width `config.latent_dim`), so a
token's cache is that latent plus one rotated key of width `config.latent_rope_dim` shared by every
head. RoPE cannot touch the up-projected keys: a rotation between the query and the key
up-projection would stop the up-projection being folded into the query at decode ("absorbed"
attention over the latent). So positions live only in a small decoupled part: each head's query has
a no-position part (dotted with the up-projected key) and a rotated part (dotted with the shared
rotated key). DeepSeek-V2, section 2.1: https://arxiv.org/abs/2405.04434.

The scheme's cache per layer is one tensor, (B, 1, T, d_c + d_R): each token's latent, which carries
no position, then its rotated key, which carries every position (the columns `move_keys` turns).
No K and no V: at decode it is both the one shared key and, its first d_c columns, the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from contract.kv_spec import LayerCacheSpec
from models.config import ModelConfig

LayerCache = tuple[Tensor]  # ([latent; rotated key],), (B, 1, T, d_c + d_R)
Rotation = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # models.positional.QueryKeyRotation


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
        self.in_place, self.absorbed, self.fused = False, False, False

    def cache_spec(self) -> LayerCacheSpec:
        """One entry a token, [latent; rotated key] (contract.kv_spec)."""
        return LayerCacheSpec.latent(self.latent_dim, self.rope_dim)

    def empty_past(self, batch: int, dtype: torch.dtype, device: torch.device) -> LayerCache:
        return (torch.zeros((batch, 1, 0, self.latent_dim + self.rope_dim), dtype=dtype, device=device),)

    def serve_in_place(self, absorbed: bool = True) -> None:
        """Serving layout: read the cache in place, return only the new entries; attend over the cached
        latents in absorbed form, or (`absorbed` False, bench/latent.py's yardstick) up-project every
        cached latent to per-head keys and values each call, as a model whose keys carried RoPE on every
        dimension would have to (rotated full keys cannot be cached compressed)."""
        self.in_place, self.absorbed = True, absorbed

    def serve_prompts_in_place(self) -> None:
        """Serving layout for prompts: up-project the cached latents and attend through one fused
        kernel. A call of T new tokens over P cached ones costs the absorbed form about T x P x 1,280
        multiply-adds a layer and this one T x P x 640 plus P x 16,384 for the up-projection, so from
        about 50 new tokens a call on this form is the cheaper (DeepSeek-V2 prefills the same way)."""
        self.serve_in_place(absorbed=False)
        self.use_fused_kernel()

    def use_fused_kernel(self) -> None:
        self.fused = True

    def forward(
        self, x: Tensor, score_bias: Tensor, rotation: Rotation, past: LayerCache
    ) -> tuple[Tensor, LayerCache]:
        batch, seq, width = x.shape
        q = self.query(x).view(batch, seq, self.n_heads, self.head_dim + self.rope_dim).transpose(1, 2)
        q_plain, q_rotated = q.split((self.head_dim, self.rope_dim), dim=-1)  # (B, nh, T, hs), (B, nh, T, d_R)
        latent, rotated_key = self.kv_down(x).split((self.latent_dim, self.rope_dim), dim=-1)
        latent = self.latent_norm(latent).unsqueeze(1)  # (B, 1, T, d_c)
        q_rotated, rotated_key = rotation(q_rotated, rotated_key.unsqueeze(1))  # rotated_key (B, 1, T, d_R)
        new = torch.cat((latent, rotated_key), dim=-1)  # (B, 1, T, d_c + d_R)
        if self.in_place and self.absorbed:
            y = self._attend_absorbed(q_plain, q_rotated, past[0], new, score_bias)
        else:
            y = self._attend_up_projected(q_plain, q_rotated, torch.cat((past[0], new), dim=2), score_bias)
        present = new if self.in_place else torch.cat((past[0], new), dim=2)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, width)), (present,)

    def _heads(self, projection: nn.Linear, latents: Tensor) -> Tensor:
        """Latents (B, 1, T, d_c) up-projected to (B, nh, T, hs)."""
        batch, _, length, _ = latents.shape
        return projection(latents[:, 0]).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)

    def _attend_up_projected(self, q_plain: Tensor, q_rotated: Tensor, cache: Tensor, score_bias: Tensor) -> Tensor:
        latents, rotated_keys = cache.split((self.latent_dim, self.rope_dim), dim=-1)
        keys = torch.cat((self._heads(self.key_up, latents), rotated_keys.expand(-1, self.n_heads, -1, -1)), -1)
        values = self._heads(self.value_up, latents)
        query = torch.cat((q_plain, q_rotated), dim=-1)
        if self.fused and self.training:  # values padded to the query's width: PyTorch's fused CPU
            # kernel (forward and backward) wants one head width; else it falls back to plain products
            padded = F.pad(values, (0, query.shape[-1] - values.shape[-1]))
            mask = score_bias.to(query.dtype)
            y = F.scaled_dot_product_attention(query, keys, padded, attn_mask=mask, scale=self.scale)
            return y[..., : self.head_dim]
        if self.fused:  # the exported prompt graph: one Attention node, values as they are
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
        self, q_plain: Tensor, q_rotated: Tensor, past: Tensor, new: Tensor, score_bias: Tensor
    ) -> Tensor:
        """One shared head whose key is [latent; rotated key] and whose value is the latent. The heads'
        queries are stacked as rows of one query matrix (multi-query attention's layout), so each
        product is one matrix product against the cache as it lies: no copy of it per head, no
        slice of its latent columns (the mix runs over whole entries and drops the rotated columns
        after). Scores against the cache and the new tokens are computed apart."""
        batch, heads, seq, _ = q_plain.shape
        query = torch.cat((self.absorbed_query(q_plain), q_rotated), dim=-1)  # (B, nh, T, d_c + d_R)
        query = query.reshape(batch, 1, heads * seq, -1)  # (B, 1, nh*T, d_c + d_R)
        scores = torch.cat((query @ past.transpose(-2, -1), query @ new.transpose(-2, -1)), dim=-1)
        scores = scores.view(batch, heads, seq, -1)  # (B, nh, T, P + T)
        weights = torch.softmax(scores * self.scale + score_bias, dim=-1).view(batch, 1, heads * seq, -1)
        past_len = past.shape[2]
        mixed = weights[..., :past_len] @ past + weights[..., past_len:] @ new  # (B, 1, nh*T, d_c + d_R)
        mixed = mixed[..., : self.latent_dim].view(batch, heads, seq, self.latent_dim)  # (B, nh, T, d_c)
        w_uv = self.value_up.weight.view(self.n_heads, self.head_dim, self.latent_dim)  # (nh, hs, d_c)
        return mixed @ w_uv.transpose(-2, -1)  # (B, nh, T, hs)
