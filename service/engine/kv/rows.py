"""How a capacity class stores its rows: in the layout's float dtype, as int8 with per-token scales, or
as int8 with the model's per-channel scales (`ChannelInt8Rows`, unbounded int8 rows).

Int8 rows (the `+int8` cache policies, contract/kv_int8.py) live in classes of their own storage
kind, so a class's arrays have one dtype: int8 K/V (2 x layers, rows, heads, C, head_dim) plus their
float32 scales (2 x layers, rows, heads, C, 1), bound to the serving-int8 graph. The kind-specific
part is `FloatRows` / `Int8Rows`: what a class allocates, how float K/V are written into it (an int8
class quantizes them), and how its rows read back as float; row moves, shifts and copies go over
each of its arrays alike (`CapacityClass`). Bytes are the real ones (values plus scales) in the
budget and the stats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract.kv_int8 import SCALE_DTYPE, dequantize
from service.engine.kv.arrays import Array, Backend
from service.engine.kv.layout import INT8, INT8_CHANNEL, KVLayout


@dataclass(frozen=True)
class Int8KV:
    """A row's cache as an int8 class holds it: values (..., head_dim) int8 and scales (..., 1) float32.
    Moves between int8 classes carry it as it is (no re-quantization)."""

    values: Array
    scales: Array

    def __getitem__(self, index: Any) -> Int8KV:
        return Int8KV(self.values[index], self.scales[index])


class FloatRows:
    """A class's K/V in the layout's float dtype: one array, written and read as it is."""

    def __init__(self, backend: Backend, layout: KVLayout, rows: int, capacity: int) -> None:
        self.dtype = layout.dtype
        self.cache = backend.zeros((layout.tensors, rows, layout.n_heads, capacity, layout.head_dim), layout.dtype)
        self.arrays = [self.cache]

    def encode(self, kv: Array) -> list[Array]:
        """Float K/V as this storage's arrays hold them."""
        return [dequantize(kv.values, kv.scales) if isinstance(kv, Int8KV) else kv]

    def read(self, index: Any) -> Array:
        """Stored K/V at `index` as float."""
        return self.cache[index]

    def raw(self, index: Any) -> Array:
        """Stored K/V at `index` as another class of this kind takes it (`write`)."""
        return self.cache[index]


class Int8Rows:
    """A class's K/V as int8 with float32 per-token scales: float K/V are quantized when written,
    and read back dequantized (float32)."""

    def __init__(self, backend: Backend, layout: KVLayout, rows: int, capacity: int) -> None:
        shape = (layout.tensors, rows, layout.n_heads, capacity)
        self.dtype = "float32"
        self.cache = backend.zeros((*shape, layout.head_dim), INT8)
        self.scales = backend.zeros((*shape, 1), SCALE_DTYPE)
        self.arrays = [self.cache, self.scales]
        self._quantize = backend.quantize

    def encode(self, kv: Array) -> list[Array]:
        if isinstance(kv, Int8KV):
            return [kv.values, kv.scales]
        return list(self._quantize(kv))

    def read(self, index: Any) -> Array:
        return dequantize(self.cache[index], self.scales[index])

    def raw(self, index: Any) -> Int8KV:
        return Int8KV(self.cache[index], self.scales[index])


class ChannelInt8Rows:
    """A class's K/V as int8 with the model's fixed per-channel scales (contract/kv_int8.py's channel
    format): one int8 array, which the fused int8 graph reads and appends to inside its kernel. Float
    K/V are quantized when written (whole rows, (tensors, heads, n, head_dim)); a row moved from
    another class of this kind is copied as it is."""

    def __init__(self, backend: Backend, layout: KVLayout, rows: int, capacity: int) -> None:
        assert layout.channel_scales is not None, "int8-channel rows need the model's channel scales"
        self.dtype = "float32"
        self.cache = backend.zeros((layout.tensors, rows, layout.n_heads, capacity, layout.head_dim), INT8)
        self.arrays = [self.cache]
        self._backend = backend
        self._scales = backend.upload(layout.channel_scales)  # (tensors, heads, 1, head_dim)

    def encode(self, kv: Array) -> list[Array]:
        if kv.dtype == self.cache.dtype:
            return [kv]
        return [self._backend.quantize_channels(kv, self._scales)]

    def read(self, index: Any) -> Array:
        raise NotImplementedError("int8-channel rows hold unbounded rows only: nothing reads them back as float")

    def raw(self, index: Any) -> Array:
        return self.cache[index]


Rows = FloatRows | Int8Rows | ChannelInt8Rows


def make_rows(kind: str, backend: Backend, layout: KVLayout, rows: int, capacity: int) -> Rows:
    if kind == INT8:
        return Int8Rows(backend, layout, rows, capacity)
    if kind == INT8_CHANNEL:
        return ChannelInt8Rows(backend, layout, rows, capacity)
    if kind != layout.dtype:
        raise ValueError(f"storage kind must be {layout.dtype}, {INT8} or {INT8_CHANNEL}, got {kind!r}")
    return FloatRows(backend, layout, rows, capacity)
