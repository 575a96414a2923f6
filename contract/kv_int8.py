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
token at a time, is the layout served to bounded (`window+int8`, `sinks+int8`) rows.

The unbounded `int8` cache has a second format, the one ONNX Runtime's GroupQueryAttention reads
inside its kernel (`k_quant_type` / `v_quant_type` PER_CHANNEL, `kv_cache_bit_width` 8): fixed
scales per layer, K or V, head and channel, `scale = max|x| / 127` over a calibration text
(export/int8_channels.py), `q = clamp(round(x / scale), -128, 127)`. No per-token scales travel
with the cache (1,024 bytes a token against 1,152), the kernel quantizes each new token itself and
dequantizes inside attention, so no float copy of the cache is made; a value beyond its channel's
calibrated range is clipped (to [-128, 127], as the kernel clips). The new token attends to its own
K/V as stored (quantized), where the per-token format's new token attends to its float32 K/V.
"""

from __future__ import annotations

from typing import Any

import numpy as np

QMAX = 127
CHANNEL_QMIN = -128  # the channel format's lower bound: the kernel clips to int8's full range
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


def quantize_channels(x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """x (..., head_dim) float -> int8 in the channel format, `scales` broadcasting against x
    (the kernel's rounding: half to even, clipped to [CHANNEL_QMIN, QMAX])."""
    x = np.asarray(x, dtype=np.float32)
    return np.clip(np.rint(x / scales), CHANNEL_QMIN, QMAX).astype(np.int8)


def fake_quantize_channels(x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """x as the channel-format cache returns it, float32."""
    return quantize_channels(x, scales).astype(np.float32) * scales
