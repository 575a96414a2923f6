"""Decoder-only transformer (pre-LayerNorm, GELU MLP, tied embeddings) with a KV cache.

Read top-down: Transformer -> Block -> CausalSelfAttention / MLP. The positional scheme is
asked once per forward (`models.positional`); layers only apply what it returned.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn import functional as F

from models.config import ModelConfig
from models.positional import LayerGroup, QueryKeyRotation, build_positional

KeyValue = tuple[Tensor, ...]  # (K, V), each (B, nh, T, hs); a scheme with its own attention may cache otherwise


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.positional = build_positional(config)
        self.blocks = nn.ModuleList(
            Block(config, self.positional.attention(config) or CausalSelfAttention(config))
            for _ in range(config.n_layers)
        )
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.apply(self._init_weights)
        # Scaled init of residual projections, per GPT-2 (https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf).
        for name, param in self.named_parameters():
            if name.endswith(("out_proj.weight", "down.weight")):
                nn.init.normal_(param, mean=0.0, std=config.init_std / math.sqrt(2 * config.n_layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    def return_new_key_values_only(self) -> Transformer:
        """Switch to the serving layout: layers read the past in place and return only new K/V."""
        for block in self.blocks:
            block.attn.serve_in_place()
        return self

    def serve_prompts_in_place(self) -> Transformer:
        """The serving layout in the form prompts want, for attention that has one (latent attention:
        up-projected, models/latent.py); the others have one form and refuse."""
        for block in self.blocks:
            if not hasattr(block.attn, "serve_prompts_in_place"):
                raise ValueError(f"{self.config.scheme}: its attention serves prompts and steps in one form")
            block.attn.serve_prompts_in_place()
        return self

    def attend_with_fused_kernel(self) -> Transformer:
        """Switch to PyTorch's fused attention (training): the same mathematics in one kernel, and a
        faster training step (README, Training speed). Export keeps the explicit graph."""
        for block in self.blocks:
            block.attn.use_fused_kernel()
        return self

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: list[KeyValue] | None = None,
    ) -> tuple[Tensor, list[KeyValue]]:
        """input_ids (B, T); attention_mask (B, past+T), 1 = real token; position_ids (B, T).

        Returns logits (B, T, vocab) and the present K/V per layer, (B, nh, past+T, hs).
        Positions default to the count of real tokens before each one, which makes
        left-padded batches and cached decoding see the positions of a lone sequence.
        """
        batch, seq = input_ids.shape
        dtype = self.token_embedding.weight.dtype
        if past_key_values is None:
            past_key_values = [block.attn.empty_past(batch, dtype, input_ids.device) for block in self.blocks]
        past = past_key_values[0][0].shape[2]
        if attention_mask is None:
            attention_mask = input_ids.new_ones((batch, past + seq))
        key_positions = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)  # (B, Tk)
        if position_ids is None:
            position_ids = key_positions[:, -seq:]

        x = self.token_embedding(input_ids)  # (B, T, d)
        position_embedding = self.positional.input_embedding(position_ids)
        if position_embedding is not None:
            x = x + position_embedding.to(dtype)
        # What each layer applies, computed once per group of layers that attend alike.
        applied: list[tuple[Tensor, QueryKeyRotation]] = [None] * self.config.n_layers  # type: ignore[list-item]
        for group in self.positional.layer_groups():
            score_bias = self._score_bias(attention_mask, position_ids, key_positions, seq, dtype, group)
            rotation = group.positional.rotation(position_ids)
            for layer in group.layers:
                applied[layer] = (score_bias, rotation)

        presents: list[KeyValue] = []
        for block, (score_bias, rotation), layer_past in zip(self.blocks, applied, past_key_values, strict=True):
            x, present = block(x, score_bias, rotation, layer_past)
            presents.append(present)
        x = self.final_norm(x)
        logits = F.linear(x, self.token_embedding.weight)  # tied: (B, T, vocab)
        return logits, presents

    def _score_bias(
        self,
        attention_mask: Tensor,
        query_positions: Tensor,
        key_positions: Tensor,
        seq: int,
        dtype: torch.dtype,
        group: LayerGroup,
    ) -> Tensor:
        """Causal + padding (+ sliding-window) mask merged with the group's logit bias: (B, H|1, Tq, Tk).

        A query may also always see itself, so a padding query's row is never fully masked
        (a fully masked row would turn into NaN and poison the cache). The window counts real
        tokens (mask positions), so left padding does not shrink it.
        """
        total = attention_mask.shape[1]
        key_index = torch.arange(total, device=attention_mask.device)  # (Tk,)
        query_index = torch.arange(seq, device=attention_mask.device) + (total - seq)  # (Tq,)
        causal = key_index[None, :] <= query_index[:, None]  # (Tq, Tk)
        itself = key_index[None, :] == query_index[:, None]
        allowed = causal[None] & attention_mask[:, None, :].bool()  # (B, Tq, Tk)
        if group.window is not None:
            distance = key_positions[:, -seq:, None] - key_positions[:, None, :]  # (B, Tq, Tk)
            allowed = allowed & (distance < group.window)
        allowed = allowed | itself[None]
        bias = group.positional.attention_bias(query_positions, key_positions)
        visible = torch.zeros((), dtype=dtype) if bias is None else bias.to(dtype)
        return torch.where(allowed[:, None], visible, torch.finfo(dtype).min)

    # ------------------------------------------------------------------ persistence

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(directory / "model.safetensors"))
        self.config.save(directory / "config.json")

    @classmethod
    def load(cls, directory: Path) -> Transformer:
        model = cls(ModelConfig.load(directory / "config.json"))
        model.load_state_dict(load_file(str(directory / "model.safetensors")))
        return model.eval()


class Block(nn.Module):
    def __init__(self, config: ModelConfig, attention: nn.Module) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.attn = attention
        self.mlp_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, score_bias: Tensor, rotation: QueryKeyRotation, past: KeyValue
    ) -> tuple[Tensor, KeyValue]:
        attended, present = self.attn(self.attn_norm(x), score_bias, rotation, past)
        x = x + attended
        x = x + self.mlp(self.mlp_norm(x))
        return x, present


def attend_concatenated(
    q: Tensor, k: Tensor, v: Tensor, past: KeyValue, score_bias: Tensor, scale: float
) -> tuple[Tensor, KeyValue]:
    """Optimum / onnxruntime-genai layout: the cache grows inside the graph, present = past + new."""
    k = torch.cat((past[0], k), dim=2)  # (B, nh, past+T, hs)
    v = torch.cat((past[1], v), dim=2)  # (B, nh, past+T, hs)
    weights = torch.softmax((q @ k.transpose(-2, -1)) * scale + score_bias, dim=-1)  # (B, nh, T, past+T)
    return weights @ v, (k, v)


def attend_fused(
    q: Tensor, k: Tensor, v: Tensor, past: KeyValue, score_bias: Tensor, scale: float
) -> tuple[Tensor, KeyValue]:
    """`attend_concatenated` through `F.scaled_dot_product_attention` (the bias is its float mask)."""
    k = torch.cat((past[0], k), dim=2)  # (B, nh, past+T, hs)
    v = torch.cat((past[1], v), dim=2)  # (B, nh, past+T, hs)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=score_bias.to(q.dtype), scale=scale), (k, v)


def attend_in_place(
    q: Tensor, k: Tensor, v: Tensor, past: KeyValue, score_bias: Tensor, scale: float
) -> tuple[Tensor, KeyValue]:
    """Serving layout: read the engine's cache buffer as it is and return only the new K/V.

    Same mathematics as `attend_concatenated`, but the cache is never copied: scores against
    the past and against the new tokens are computed apart and joined (a tensor of
    (B, nh, T, past+T) scores, far smaller than the cache).
    """
    past_len = past[0].shape[2]
    scores = torch.cat((q @ past[0].transpose(-2, -1), q @ k.transpose(-2, -1)), dim=-1)  # (B, nh, T, past+T)
    weights = torch.softmax(scores * scale + score_bias, dim=-1)
    y = weights[..., :past_len] @ past[1] + weights[..., past_len:] @ v  # (B, nh, T, hs)
    return y, (k, v)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)
        self.attend = attend_concatenated

    def empty_past(self, batch: int, dtype: torch.dtype, device: torch.device) -> KeyValue:
        empty = torch.zeros((batch, self.n_heads, 0, self.head_dim), dtype=dtype, device=device)
        return empty, empty

    def serve_in_place(self) -> None:
        """Serving layout: read the past in place, return only the new K/V."""
        self.attend = attend_in_place

    def use_fused_kernel(self) -> None:
        self.attend = attend_fused

    def forward(
        self, x: Tensor, score_bias: Tensor, rotation: QueryKeyRotation, past: KeyValue
    ) -> tuple[Tensor, KeyValue]:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q = q.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        q, k = rotation(q, k)
        y, present = self.attend(q, k, v, past, score_bias, 1.0 / math.sqrt(self.head_dim))
        y = y.transpose(1, 2).reshape(batch, seq, width)  # (B, T, d)
        return self.out_proj(y), present


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.d_ff is not None
        self.up = nn.Linear(config.d_model, config.d_ff)
        self.down = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))
