"""The KV store and its parts: every sequence's K/V cache for one model, within a memory budget.

- `layout`: what one token's cache is made of (`KVLayout`, made from a manifest by `serving_layout`) and
  the storage kinds (float, `INT8`).
- `arrays`: where the memory lives (`NumpyArrays` on the host, `TorchArrays` on CPU or CUDA).
- `region`: host memory in which a class changes its row count in place (`RowRegion`).
- `rows`: how a class stores its rows (`FloatRows`, `Int8Rows` with per-token scales).
- `local`: a hybrid's sliding-window layers' K/V, a fixed number of columns per row (`LocalRows`).
- `classes`: dense in-place batches of one row width (`CapacityClass`) on a ladder of widths,
- `spec`: the typed specs: a layer group's (`FullAttentionSpec`, `LatentAttentionSpec`,
  `SlidingWindowSpec`), what rows of a storage kind are (`StorageSpec`) and a row's eviction state
  (`RowEviction`).
- `store`: the owner of it all (`KVStore`), whose accounting is its allocation.

Why capacity classes (compared side by side with `python -m service.bench`): one left-padded batch
wastes most of its memory with mixed lengths; a block pool gathered inside the graph would copy the
whole batch cache every step; classes keep the in-place serving graph and cost one graph call per
class.
"""

from service.engine.kv.arrays import Array, Backend, NumpyArrays, TorchArrays, make_backend
from service.engine.kv.classes import CapacityClass, capacity_ladder
from service.engine.kv.layout import INT8, INT8_CHANNEL, KVLayout, local_width, serving_layout, sliding_window
from service.engine.kv.local import LocalRows
from service.engine.kv.rows import Int8KV, SplitKV
from service.engine.kv.spec import (
    FullAttentionSpec,
    LatentAttentionSpec,
    RowEviction,
    SlidingWindowSpec,
    StorageSpec,
)
from service.engine.kv.store import KVBudgetError, KVStore, StoreStats

__all__ = [
    "INT8",
    "INT8_CHANNEL",
    "Array",
    "Backend",
    "CapacityClass",
    "FullAttentionSpec",
    "Int8KV",
    "KVBudgetError",
    "KVLayout",
    "KVStore",
    "LatentAttentionSpec",
    "LocalRows",
    "NumpyArrays",
    "RowEviction",
    "SlidingWindowSpec",
    "SplitKV",
    "StorageSpec",
    "StoreStats",
    "TorchArrays",
    "capacity_ladder",
    "local_width",
    "make_backend",
    "serving_layout",
    "sliding_window",
]
