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
from service.engine.kv.region import RowMemory


@dataclass(frozen=True)
class Int8KV:
    """A row's cache as an int8 class holds it: values (..., head_dim) int8 and scales (..., 1) float32.
    Moves between int8 classes carry it as it is (no re-quantization)."""

    values: Array
    scales: Array

    def __getitem__(self, index: Any) -> Int8KV:
        return Int8KV(self.values[index], self.scales[index])


@dataclass(frozen=True)
class SplitKV:
    """A hybrid row's cache (its KVLayout.local kept apart): the global layers' K/V of every token,
    (2 x global layers, heads, n, head_dim), and the local layers' of the sequence's last m <= n tokens,
    (2 x local layers, heads, m, head_dim). Moves between classes carry it as it is."""

    global_kv: Array
    local_kv: Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The global part's: its token count is the sequence's."""
        return tuple(self.global_kv.shape)


class _Rows:
    """What every kind shares: its arrays come from a `RowMemory`, and on the host they change their
    row count in place (`resize`)."""

    memory: RowMemory
    arrays: list[Array]

    def _bind(self, arrays: list[Array]) -> None:
        self.arrays = arrays
        self.cache = arrays[0]

    def resize(self, rows: int, kept: int) -> None:
        """The arrays laid out again with `rows` rows, the first `kept` keeping their K/V (`memory.in_place` only)."""
        self._bind(self.memory.resized(self.arrays, rows, kept))


class FloatRows(_Rows):
    """A class's K/V in the layout's float dtype: one array, written and read as it is."""

    def __init__(self, memory: RowMemory, layout: KVLayout, rows: int, capacity: int) -> None:
        self.dtype, self.memory = layout.dtype, memory
        self._bind([memory.zeros((layout.tensors, rows, layout.n_heads, capacity, layout.head_dim), layout.dtype)])

    def encode(self, kv: Array) -> list[Array]:
        """Float K/V as this storage's arrays hold them."""
        return [dequantize(kv.values, kv.scales) if isinstance(kv, Int8KV) else kv]

    def read(self, index: Any) -> Array:
        """Stored K/V at `index` as float."""
        return self.cache[index]

    def raw(self, index: Any) -> Array:
        """Stored K/V at `index` as another class of this kind takes it (`write`)."""
        return self.cache[index]


class Int8Rows(_Rows):
    """A class's K/V as int8 with float32 per-token scales: float K/V are quantized when written,
    and read back dequantized (float32)."""

    def __init__(self, memory: RowMemory, layout: KVLayout, rows: int, capacity: int) -> None:
        shape = (layout.tensors, rows, layout.n_heads, capacity)
        self.dtype, self.memory = "float32", memory
        self._bind([memory.zeros((*shape, layout.head_dim), INT8), memory.zeros((*shape, 1), SCALE_DTYPE)])
        self._quantize = memory.backend.quantize

    def _bind(self, arrays: list[Array]) -> None:
        super()._bind(arrays)
        self.scales = arrays[1]

    def encode(self, kv: Array) -> list[Array]:
        if isinstance(kv, Int8KV):
            return [kv.values, kv.scales]
        return list(self._quantize(kv))

    def read(self, index: Any) -> Array:
        return dequantize(self.cache[index], self.scales[index])

    def raw(self, index: Any) -> Int8KV:
        return Int8KV(self.cache[index], self.scales[index])


class ChannelInt8Rows(_Rows):
    """A class's K/V as int8 with the model's fixed per-channel scales (contract/kv_int8.py's channel
    format): one int8 array, which the fused int8 graph reads and appends to inside its kernel. Float
    K/V are quantized when written (whole rows, (tensors, heads, n, head_dim)); a row moved from
    another class of this kind is copied as it is."""

    def __init__(self, memory: RowMemory, layout: KVLayout, rows: int, capacity: int) -> None:
        assert layout.channel_scales is not None, "int8-channel rows need the model's channel scales"
        self.dtype, self.memory = "float32", memory
        self._bind([memory.zeros((layout.tensors, rows, layout.n_heads, capacity, layout.head_dim), INT8)])
        self._scales = memory.backend.upload(layout.channel_scales)  # (tensors, heads, 1, head_dim)

    def encode(self, kv: Array) -> list[Array]:
        if kv.dtype == self.cache.dtype:
            return [kv]
        return [self.memory.backend.quantize_channels(kv, self._scales)]

    def read(self, index: Any) -> Array:
        raise NotImplementedError("int8-channel rows hold unbounded rows only: nothing reads them back as float")

    def raw(self, index: Any) -> Array:
        return self.cache[index]


Rows = FloatRows | Int8Rows | ChannelInt8Rows


def make_rows(kind: str, backend: Backend, layout: KVLayout, rows: int, capacity: int, reserve_bytes: int = 0) -> Rows:
    """A class's storage; `reserve_bytes` (the budget) lets host arrays change their row count in place."""
    memory = RowMemory(backend, reserve_bytes)
    if kind == INT8:
        return Int8Rows(memory, layout, rows, capacity)
    if kind == INT8_CHANNEL:
        return ChannelInt8Rows(memory, layout, rows, capacity)
    if kind != layout.dtype:
        raise ValueError(f"storage kind must be {layout.dtype}, {INT8} or {INT8_CHANNEL}, got {kind!r}")
    return FloatRows(memory, layout, rows, capacity)
