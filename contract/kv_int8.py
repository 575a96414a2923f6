"""The int8 K/V cache's number format: one definition, used by the store (numpy; its torch backend
repeats these few lines with torch's operations, service/engine/kv/arrays.py), the
PyTorch reference (models/streaming.py) and the serving-int8 graph (which only dequantizes).

Symmetric per-token quantization: each cached token's key (or value) vector of one head, `head_dim`
numbers, is stored as int8 `q` with one float32 scale, `scale = max|x| / 127`, `q = round(x / scale)`
(ties to even), so `|q x scale - x| <= scale / 2`. A zero vector gets scale 1 (q = 0, exact).

Chosen by measurement (`python -m export.int8_study`, numbers in its docstring): keys quantized
per channel (KIVI: Liu et al. 2024, https://arxiv.org/abs/2402.02750) need scales fixed over a
group of tokens and the unfinished group kept in float32, and changed bits per byte at 1x no more
than per-token keys on these models (both within 0.05% on every scheme); per token, written one
token at a time, is the layout served.
"""

from __future__ import annotations

from typing import Any

import numpy as np

QMAX = 127
SCALE_DTYPE = "float32"


def quantize_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (..., head_dim) float -> (int8 (..., head_dim), float32 scales (..., 1))."""
    x = np.asarray(x, dtype=np.float32)
    top = np.abs(x).max(axis=-1, keepdims=True)
    scale = np.where(top > 0, top / np.float32(QMAX), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(x / scale), -QMAX, QMAX).astype(np.int8)
    return q, scale


def dequantize(q: Any, scale: Any) -> Any:
    """int8 values times their scales, float32 (numpy or torch alike)."""
    if isinstance(q, np.ndarray):
        return q.astype(np.float32) * scale
    return q.float() * scale


def fake_quantize(x: np.ndarray) -> np.ndarray:
    """x as the int8 cache returns it (quantized, then dequantized), float32."""
    return dequantize(*quantize_numpy(x))
