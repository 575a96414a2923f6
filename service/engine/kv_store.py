"""The KV store: the one owner of a model's K/V memory, sized by the budget the scheduler admits against.

Sequences live in dense in-place batches by capacity class. A class of capacity C is one array
(2 x layers, rows, heads, C, head_dim) that the serving graph reads in place; each row is one
sequence, left-aligned (token i at column i) with its own length, unused columns masked. The
capacities form a geometric ladder (x1.25, in whole blocks): a sequence that fills its row moves
to a row of the next class (one copy of its own cache), so a row is at least ~80% used and a short
sequence never pays for a long one's width, as it did in one left-padded batch. Each class with
rows costs one graph call per step, mostly fixed cost, so a sequence whose own rung has no rows
joins the rung above when that one has (`_placement`: the row is still >= 64% used); measured with
16 streams of 128-token requests: 2.33 calls per step became 1.49, mixed-lengths used/physical 0.85.
For the same reason a class whose rows would all stay >= 64% full one rung up moves there whole when
one of them fills (`_movers`): one re-allocation, and still one call per step.

Accounting and memory are the same thing here: `reserve` allocates the row (or grows the class
array) at once, or says no, and refuses anything that would take the allocated bytes, counted
with the old array still alive while a class is re-allocated, above the budget. Rows are written
on the array's own device (numpy on the host, or torch tensors on CPU or CUDA, bound to ONNX
Runtime by data pointer), so joins, moves, leaves and each step's new column never cross the bus.

Int8 rows (the `+int8` cache policies, contract/kv_int8.py) live in classes of their own storage
kind, so a class's arrays have one dtype: int8 K/V (2 x layers, rows, heads, C, head_dim) plus their
float32 scales (2 x layers, rows, heads, C, 1), bound to the serving-int8 graph. The kind-specific
part is `FloatRows` / `Int8Rows`: what a class allocates, how float K/V are written into it (an int8
class quantizes them), and how its rows read back as float; row moves, shifts and copies go over
each of its arrays alike. Bytes are the real ones (values plus scales) in the budget and the stats.

Measured side by side before choosing (`python -m service.bench`): one left-padded batch wastes
most of its memory with mixed lengths; a block pool gathered inside the graph would copy the whole
batch cache every step; classes keep today's in-place graph and cost one graph call per class.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from contract.kv_int8 import QMAX, SCALE_DTYPE, dequantize, quantize_numpy
from contract.manifest import DTYPE_BYTES, INT8_SCALE_BYTES

Array = Any  # np.ndarray or torch.Tensor, as the backend makes them

GROWTH = 1.25  # capacity ratio between neighbouring classes: a row is >= 1/GROWTH full
# A class moves up the ladder as a whole when each of its rows would be at least this full there.
PROMOTED_FILL = 1 / GROWTH**2
SMALLEST_CLASS_BLOCKS = 4
INT8 = "int8"  # the storage kind of int8 rows (float rows' kind is the layout's dtype)
_VERSIONS = itertools.count()  # binding versions, unique across re-made classes


class KVBudgetError(ValueError):
    """The budget cannot hold one sequence of the longest allowed length."""


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's cache: K and V of every layer and head."""

    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str  # float32 | float16

    @property
    def tensors(self) -> int:
        return 2 * self.n_layers

    @property
    def token_bytes(self) -> int:
        return self.tensors * self.n_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def kind_token_bytes(self, kind: str) -> int:
        """One token's bytes in rows of a storage kind (INT8: int8 values plus a float32 scale per head)."""
        if kind == INT8:
            return self.tensors * self.n_heads * (self.head_dim + INT8_SCALE_BYTES)
        return self.token_bytes


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


Rows = FloatRows | Int8Rows


def make_rows(kind: str, backend: Backend, layout: KVLayout, rows: int, capacity: int) -> Rows:
    if kind == INT8:
        return Int8Rows(backend, layout, rows, capacity)
    if kind != layout.dtype:
        raise ValueError(f"storage kind must be {layout.dtype} or {INT8}, got {kind!r}")
    return FloatRows(backend, layout, rows, capacity)


class NumpyArrays:
    """Host memory (the CPU serving path)."""

    device_type = "cpu"
    device_id = 0

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def upload(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def download(self, array: np.ndarray) -> np.ndarray:
        return array

    def pointer(self, array: np.ndarray) -> int:
        assert array.flags.c_contiguous
        return int(array.ctypes.data)

    def concatenate(self, arrays: list[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(arrays, axis=axis)

    def rows_first(self, array: np.ndarray) -> np.ndarray:
        return np.swapaxes(array, 0, 1)

    def synchronize(self) -> None:
        """Host arrays: writes are done when the call returns."""

    def arange(self, n: int) -> np.ndarray:
        return np.arange(n, dtype=np.int64)

    def copy(self, array: np.ndarray) -> np.ndarray:
        return array.copy()

    def quantize(self, array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int8 values and float32 per-token scales (contract.kv_int8)."""
        return quantize_numpy(array)


class TorchArrays:
    """torch tensors on a device (CUDA in production; CPU in CI, to run the GPU path's code),
    bound to ONNX Runtime by data pointer as Hugging Face Optimum's ONNX Runtime models do."""

    def __init__(self, device: str = "cpu") -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.device_type = self.device.type
        self.device_id = self.device.index or 0
        self._dtypes = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64, INT8: torch.int8}

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Array:
        return self.torch.zeros(shape, dtype=self._dtypes[dtype], device=self.device)

    def upload(self, array: np.ndarray) -> Array:
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def download(self, array: Array) -> np.ndarray:
        return array.detach().cpu().numpy()

    def pointer(self, array: Array) -> int:
        assert array.is_contiguous()
        return int(array.data_ptr())

    def concatenate(self, arrays: list[Array], axis: int) -> Array:
        return self.torch.cat(arrays, dim=axis)

    def rows_first(self, array: Array) -> Array:
        return array.transpose(0, 1)

    def synchronize(self) -> None:
        """Wait for torch's queued writes before ONNX Runtime, on its own CUDA stream, reads them."""
        if self.device_type == "cuda":
            self.torch.cuda.current_stream(self.device).synchronize()

    def arange(self, n: int) -> Array:
        return self.torch.arange(n, dtype=self.torch.int64, device=self.device)

    def copy(self, array: Array) -> Array:
        return array.clone()

    def quantize(self, array: Array) -> tuple[Array, Array]:
        """contract.kv_int8.quantize_numpy in torch, on the array's device (the same rounding: half to even)."""
        torch = self.torch
        array = array.to(torch.float32)
        top = array.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(top > 0, top / QMAX, torch.ones_like(top))
        return torch.clamp(torch.round(array / scale), -QMAX, QMAX).to(torch.int8), scale


Backend = NumpyArrays | TorchArrays


def _populated(klass: CapacityClass | None) -> bool:
    return klass is not None and bool(klass.members or klass.reserved)


def capacity_ladder(max_tokens: int, block_size: int) -> list[int]:
    """Row capacities in tokens: whole blocks, x GROWTH apart, the last one exactly `max_tokens`."""
    ladder: list[int] = []
    capacity = SMALLEST_CLASS_BLOCKS * block_size
    while capacity < max_tokens:
        ladder.append(capacity)
        capacity = max(capacity + block_size, -(-math.ceil(capacity * GROWTH) // block_size) * block_size)
    ladder.append(max_tokens)
    return ladder


@dataclass
class RowPolicy:
    """A row's cache policy (contract.cache_policy) and its eviction state.

    `budget` 0 is `full`. A bounded row never holds more than `budget` tokens: the step that would
    exceed it first evicts the oldest token after the `sinks` (its row shifts left by one column,
    a copy of at most `budget` tokens, the same every step). `original_positions`: the next
    position counts evicted tokens too (absolute schemes, and RoPE, whose sink keys are instead
    moved by `evicted` positions from `anchor`, their keys before the first eviction)."""

    budget: int = 0
    sinks: int = 0
    original_positions: bool = True
    evicted: int = 0
    anchor: Array | None = None  # (n_layers, heads, sinks, head_dim), RoPE sinks only


class CapacityClass:
    """One dense in-place batch: rows of `capacity` token columns, members in rows [0, B), stored
    as `kind` (the layout's dtype, or INT8)."""

    def __init__(
        self,
        backend: Backend,
        layout: KVLayout,
        capacity: int,
        rows: int,
        rotary_inv_freq: np.ndarray | None = None,
        kind: str | None = None,
    ) -> None:
        self.backend, self.layout, self.capacity = backend, layout, capacity
        self.kind = kind or layout.dtype
        self.rotary_inv_freq = rotary_inv_freq
        self.storage = make_rows(self.kind, backend, layout, rows, capacity)
        self.cache = self.storage.cache  # (2 x layers, rows, heads, capacity, head_dim)
        # mask: (rows, capacity + 1); the last column is the token fed by the step, always 1.
        self.mask = backend.zeros((rows, capacity + 1), "int64")
        self.mask[:, capacity] = 1
        self.positions = backend.zeros((rows, 1), "int64")  # the position the next token is fed at
        self.input_ids = backend.zeros((rows, 1), "int64")
        self.row_index = backend.arange(rows)
        self.lengths = np.zeros(rows, dtype=np.int64)  # cached tokens per row (host: no device reads)
        self.policies: list[RowPolicy] = []  # of rows [0, B)
        self.members: list[str] = []  # sequence ids of rows [0, B)
        self.reserved: set[str] = set()  # promised a row here, not yet written (prefill, or a move)
        self.uniform = True  # every member has the same length: the step writes one column slice
        self.bounded = False  # some member has a bounded policy: steps check for evictions
        self.version = next(_VERSIONS)  # new whenever arrays or membership change (a binding is stale)

    @property
    def key(self) -> tuple[int, str]:
        return self.capacity, self.kind

    @property
    def arrays(self) -> list[Array]:
        """The cache arrays the graph reads: K/V (and, for INT8, their scales), rows on axis 1."""
        return self.storage.arrays

    def _put(self, index: Any, kv: Array, view: Any = None) -> None:
        """Float K/V (or this kind's own raw rows) into the cache arrays at `index`."""
        for array, part in zip(self.storage.arrays, self.storage.encode(kv), strict=True):
            array[index] = part if view is None else view(part)

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        return self.rows * self.capacity * self.layout.kind_token_bytes(self.kind)

    @property
    def free_rows(self) -> int:
        return self.rows - len(self.members) - len(self.reserved)

    def copy_members_from(self, old: CapacityClass) -> None:
        """Take over `old`'s members and reservations (same capacity, at least as many rows)."""
        batch = len(old.members)
        for new, previous in zip(self.arrays, old.arrays, strict=True):
            new[:, :batch] = previous[:, :batch]
        self.mask[:batch] = old.mask[:batch]
        self.positions[:batch] = old.positions[:batch]
        self.lengths[:batch] = old.lengths[:batch]
        self.members, self.reserved, self.uniform = list(old.members), set(old.reserved), old.uniform
        self.policies, self.bounded = list(old.policies), old.bounded

    def write(self, sequence_id: str, kv: Array, length: int, policy: RowPolicy | None = None) -> None:
        """A reserved sequence's cache (tensors, heads, length, head_dim), float or this kind's own
        (`row_cache` of a class of this kind), becomes the next member row."""
        policy = policy or RowPolicy()
        row = len(self.members)
        self._put((slice(None), row, slice(None), slice(None, length)), kv)
        self.mask[row, : self.capacity] = 0
        self.mask[row, :length] = 1
        self.positions[row, 0] = length + (policy.evicted if policy.original_positions else 0)
        self.lengths[row] = length
        self.reserved.discard(sequence_id)
        self.members.append(sequence_id)
        self.policies.append(policy)
        self._changed()

    def row_cache(self, row: int) -> Array:
        """A member's cache as a class of this kind takes it (for INT8, `Int8KV`)."""
        return self.storage.raw((slice(None), row, slice(None), slice(None, int(self.lengths[row]))))

    def remove(self, sequence_id: str) -> None:
        """A member leaves: the last row moves into its place (one row's copy)."""
        row = self.members.index(sequence_id)
        last = len(self.members) - 1
        if row != last:
            for array in self.arrays:
                array[:, row] = array[:, last]
            self.mask[row] = self.mask[last]
            self.positions[row] = self.positions[last]
            self.lengths[row] = self.lengths[last]
            self.members[row] = self.members[last]
            self.policies[row] = self.policies[last]
        self.members.pop()
        self.policies.pop()
        self._changed()

    def _update_uniform(self) -> None:
        batch = len(self.members)
        self.uniform = batch == 0 or bool((self.lengths[:batch] == self.lengths[0]).all())

    def _changed(self) -> None:
        self._update_uniform()
        self.bounded = any(policy.budget for policy in self.policies)
        self.version = next(_VERSIONS)

    def append_step(self, new_kv: Array | None) -> None:
        """Write the step's new K/V, (tensors, B, heads, 1, head_dim), at each member's length,
        after evicting from the rows whose policy's budget is full. None: a fused graph already
        wrote them there (share-buffer), so only masks, lengths and positions advance."""
        batch = len(self.members)
        assert new_kv is not None or not self.bounded, "bounded rows evict before the new K/V is written"
        evicted = self._evict_full_rows() if self.bounded else False
        if self.uniform:
            column = int(self.lengths[0])
            if new_kv is not None:
                self._put((slice(None), slice(None, batch), slice(None), column), new_kv[:, :, :, 0])
            self.mask[:batch, column] = 1
        else:
            rows, columns = self.row_index[:batch], self.backend.upload(self.lengths[:batch])
            if new_kv is not None:
                self._put((slice(None), rows, slice(None), columns), new_kv[:, :, :, 0], self.backend.rows_first)
            self.mask[rows, columns] = 1
        self.lengths[:batch] += 1
        if evicted:
            self._reset_positions()
        else:
            self.positions[:batch] += 1

    def _evict_full_rows(self) -> bool:
        """Make room for one token in every bounded row that holds its budget. True if any did."""
        full = [row for row, policy in enumerate(self.policies) if policy.budget and self.lengths[row] >= policy.budget]
        for row in full:
            policy, length = self.policies[row], int(self.lengths[row])
            sinks = policy.sinks
            for array in self.arrays:
                array[:, row, :, sinks : length - 1] = self.backend.copy(array[:, row, :, sinks + 1 : length])
            self.lengths[row] = length - 1
            if sinks and self.rotary_inv_freq is not None:
                keys = (slice(0, None, 2), row, slice(None), slice(None, sinks))
                if policy.anchor is None:  # as stored (INT8: dequantized), before the first move
                    policy.anchor = self.backend.copy(self.storage.read(keys))
                self._put(keys, self._rotate(policy.anchor, policy.evicted + 1))
            policy.evicted += 1
        if full:
            self._update_uniform()
        return bool(full)

    def _rotate(self, keys: Array, offset: int) -> Array:
        """RoPE keys moved `offset` positions later: a pure rotation by offset x inv_freq (the
        YaRN attention factor they carry is kept, not applied twice)."""
        assert self.rotary_inv_freq is not None
        angles = offset * self.rotary_inv_freq  # float64: exact up to fp32 rounding at any offset
        emb = np.concatenate((angles, angles))
        dtype = self.storage.dtype
        cos, sin = self.backend.upload(np.cos(emb).astype(dtype)), self.backend.upload(np.sin(emb).astype(dtype))
        half = keys.shape[-1] // 2
        rotated_half = self.backend.concatenate([-keys[..., half:], keys[..., :half]], axis=-1)
        return keys * cos + rotated_half * sin

    def _reset_positions(self) -> None:
        batch = len(self.members)
        offsets = np.fromiter(
            (p.evicted if p.original_positions else 0 for p in self.policies), dtype=np.int64, count=batch
        )
        self.positions[:batch, 0] = self.backend.upload(self.lengths[:batch] + offsets)

    def rewind(self, steps: int) -> None:
        """Take back the last `steps` tokens of every member (benchmarks measure at a fixed context;
        `full` rows only)."""
        batch = len(self.members)
        for _ in range(steps):
            self.positions[:batch] -= 1
            self.lengths[:batch] -= 1
            self.mask[self.row_index[:batch], self.positions[:batch, 0]] = 0


@dataclass(frozen=True)
class StoreStats:
    used_tokens: int  # tokens held or promised (rounded up to blocks in used_bytes)
    used_bytes: int
    physical_bytes: int  # K/V arrays allocated now
    peak_physical_bytes: int  # high-water mark, counting both arrays while a class is re-allocated
    capacity_bytes: int
    sequences: int
    classes: int


class KVStore:
    """Every sequence's cache for one model, within `budget_bytes` of allocated K/V memory."""

    def __init__(
        self,
        layout: KVLayout,
        budget_bytes: int,
        block_size: int,
        max_tokens: int,
        backend: Backend | None = None,
        rotary_inv_freq: np.ndarray | None = None,
    ) -> None:
        """`rotary_inv_freq`: a RoPE model's inverse frequencies, with which bounded policies move sink keys."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.layout, self.block_size, self.max_tokens = layout, block_size, max_tokens
        self.backend: Backend = backend or NumpyArrays()
        self.rotary_inv_freq = rotary_inv_freq
        self.block_bytes = block_size * layout.token_bytes
        self.capacity_bytes = budget_bytes // self.block_bytes * self.block_bytes
        self.ladder = capacity_ladder(max_tokens, block_size)
        minimum = self.minimum_budget(layout, max_tokens, block_size)
        if self.capacity_bytes < minimum:
            raise KVBudgetError(
                f"kv cache budget {budget_bytes} bytes cannot hold one sequence of {max_tokens} tokens "
                f"(needs at least {minimum} bytes)"
            )
        self.classes: dict[int, CapacityClass] = {}  # float rows (the layout's dtype), by capacity
        self.kinds: dict[str, dict[int, CapacityClass]] = {layout.dtype: self.classes, INT8: {}}
        self.capacity_of: dict[str, int] = {}  # sequence -> the capacity of its class
        self.kind_of: dict[str, str] = {}  # sequence -> the storage kind of its class
        self.tokens: dict[str, int] = {}  # sequence -> tokens reserved
        self.physical_bytes = 0
        self.peak_physical_bytes = 0

    @staticmethod
    def minimum_budget(layout: KVLayout, max_tokens: int, block_size: int) -> int:
        """One sequence of `max_tokens`, including its move from the class below (both rows alive)."""
        ladder = capacity_ladder(max_tokens, block_size)
        below = ladder[-2] if len(ladder) > 1 else 0
        return -(-(ladder[-1] + below) // block_size) * block_size * layout.token_bytes  # whole blocks

    def class_for(self, tokens: int) -> int:
        for capacity in self.ladder:
            if capacity >= tokens:
                return capacity
        raise ValueError(f"{tokens} tokens exceed the store's max_tokens={self.max_tokens}")

    def _placement(self, own: int, kind: str) -> int:
        """The class a sequence whose own rung of the ladder is `own` goes to: that one, or the next
        one up when that one holds rows and its own holds none. Every class with members costs one
        graph call per step, mostly fixed cost, so a row one rung wider (still >= 64% used) beats
        a call of its own."""
        classes = self.kinds[kind]
        if _populated(classes.get(own)):
            return own
        rung = self.ladder.index(own)
        if rung + 1 < len(self.ladder) and _populated(classes.get(self.ladder[rung + 1])):
            return self.ladder[rung + 1]
        return own

    def _class_of(self, sequence_id: str) -> CapacityClass | None:
        capacity = self.capacity_of.get(sequence_id)
        return None if capacity is None else self.kinds[self.kind_of[sequence_id]].get(capacity)

    # ------------------------------------------------------------------ accounting = allocation

    def capacity(self, sequence_id: str) -> int:
        """Tokens the sequence's row holds (0: none reserved)."""
        return self.capacity_of.get(sequence_id, 0)

    def reserve(self, sequence_id: str, tokens: int, int8: bool = False) -> bool:
        """Make room for `tokens` tokens of the sequence: a row for a new one (written later by
        `write`; `int8`: in an int8 class), a move to a wider class of its kind when its row is
        full. False, with nothing changed, when that would take the allocated memory above the budget."""
        if tokens > self.max_tokens:
            return False
        current = self.capacity_of.get(sequence_id)
        kind = self.kind_of.get(sequence_id) or (INT8 if int8 else self.layout.dtype)
        if current is not None and current >= tokens:
            self.tokens[sequence_id] = max(tokens, self.tokens.get(sequence_id, 0))
            return True
        own = self.class_for(tokens)
        target = self._placement(own, kind)
        moving = self._class_of(sequence_id)
        movers, rows_needed = [sequence_id], 1
        if moving is not None and sequence_id in moving.members:
            movers = self._movers(moving, sequence_id, target)
            # Members as full as this one move this step too: room for them in one re-allocation.
            full = int((moving.lengths[: len(moving.members)] >= moving.capacity).sum())
            rows_needed = max(len(movers), full)
        destination = self._room(target, rows_needed, kind)
        if destination is None and target != own:
            target = own  # the rung above cannot grow within the budget: the sequence's own rung
            destination = self._room(target, rows_needed, kind)
        if destination is None:
            self.trim(all_spare=True)
            destination = self._room(target, rows_needed, kind)
            if destination is None:
                return False
        if destination.free_rows < len(movers):
            movers = [sequence_id]  # no room for its whole class within the budget: the sequence alone
        destination.reserved.add(sequence_id)
        source = self._class_of(sequence_id)  # trim may have re-made it
        if source is not None:
            if sequence_id in source.members:  # a move: the rows' caches go with them, on the device
                for mover in reversed(movers):  # the last rows first: no row is copied twice
                    row = source.members.index(mover)
                    destination.write(mover, source.row_cache(row), int(source.lengths[row]), source.policies[row])
                    source.remove(mover)
                    self.capacity_of[mover] = target
            else:
                source.reserved.discard(sequence_id)
            self._release_if_empty(source)
        self.capacity_of[sequence_id] = target
        self.kind_of[sequence_id] = kind
        self.tokens[sequence_id] = max(tokens, self.tokens.get(sequence_id, 0))
        return True

    def _movers(self, source: CapacityClass, sequence_id: str, target: int) -> list[str]:
        """Who moves to `target` with a sequence whose row in `source` is full: the whole class when
        every member would fill at least PROMOTED_FILL of a row there (one class stays one graph
        call per step, where moving one by one would hold two calls per step until the last one
        moved, and re-allocate the wider class once per mover); else the sequence alone."""
        batch = len(source.members)
        if batch > 1 and not source.bounded and int(source.lengths[:batch].min()) >= PROMOTED_FILL * target:
            return list(source.members)
        return [sequence_id]

    def _room(self, capacity: int, rows_needed: int, kind: str) -> CapacityClass | None:
        """The class with `rows_needed` free rows, grown if it must be: with an eighth more rows of
        headroom if that fits, else exactly. Over the budget, the free rows it already has, else
        grown by the one row that must be."""
        existing = self.kinds[kind].get(capacity)
        if existing is not None and existing.free_rows >= rows_needed:
            return existing
        held = 0 if existing is None else existing.rows - existing.free_rows
        wanted = held + rows_needed
        for rows in dict.fromkeys((wanted + wanted // 8, wanted)):
            grown = self._reallocate(capacity, rows, kind)
            if grown is not None:
                return grown
        if existing is not None and existing.free_rows > 0:
            return existing
        return self._reallocate(capacity, held + 1, kind) if rows_needed > 1 else None

    def _reallocate(self, capacity: int, rows: int, kind: str) -> CapacityClass | None:
        """A new array for the class with `rows` rows, members copied over; None if the old and the
        new array together would exceed the budget."""
        old = self.kinds[kind].get(capacity)
        new_bytes = rows * capacity * self.layout.kind_token_bytes(kind)
        if self.physical_bytes + new_bytes > self.capacity_bytes:
            return None
        self.peak_physical_bytes = max(self.peak_physical_bytes, self.physical_bytes + new_bytes)
        fresh = CapacityClass(self.backend, self.layout, capacity, rows, self.rotary_inv_freq, kind)
        if old is not None:
            fresh.copy_members_from(old)
            self.physical_bytes -= old.nbytes
        self.kinds[kind][capacity] = fresh
        self.physical_bytes += fresh.nbytes
        return fresh

    def _release_if_empty(self, klass: CapacityClass) -> None:
        if not klass.members and not klass.reserved:
            self.physical_bytes -= klass.nbytes
            del self.kinds[klass.kind][klass.capacity]

    def all_classes(self) -> list[CapacityClass]:
        return [klass for classes in self.kinds.values() for klass in classes.values()]

    def has_class(self, key: tuple[int, str]) -> bool:
        capacity, kind = key
        return capacity in self.kinds[kind]

    def trim(self, all_spare: bool = False) -> None:
        """Give back spare rows where more than a quarter of a class is spare (`all_spare`: every
        spare row, when memory ran out), if the copy fits beside the old array."""
        for klass in self.all_classes():
            held = klass.rows - klass.free_rows
            if all_spare and held and klass.free_rows:
                self._reallocate(klass.capacity, held, klass.kind)
            elif held and klass.free_rows > max(1, klass.rows // 4):
                self._reallocate(klass.capacity, held + held // 8, klass.kind)

    def free(self, sequence_id: str) -> None:
        """The sequence is done (finished, aborted or preempted): its row is free at once."""
        klass = self._class_of(sequence_id)
        self.capacity_of.pop(sequence_id, None)
        self.kind_of.pop(sequence_id, None)
        self.tokens.pop(sequence_id, None)
        if klass is None:
            return
        if sequence_id in klass.members:
            klass.remove(sequence_id)
        klass.reserved.discard(sequence_id)
        self._release_if_empty(klass)

    def write(self, sequence_id: str, kv: Array, length: int, policy: RowPolicy | None = None) -> None:
        """A prefilled prompt's cache, (tensors, heads, length, head_dim), into its reserved row
        (float K/V, quantized there for an int8 row; or an int8 row's own `Int8KV`)."""
        klass = self._class_of(sequence_id)
        if klass is None or sequence_id not in klass.reserved:
            raise KeyError(f"sequence {sequence_id!r} holds no reserved row")
        if length > klass.capacity:
            raise ValueError(f"sequence {sequence_id!r}: {length} tokens exceed its row of {klass.capacity}")
        klass.write(sequence_id, kv, length, policy)

    # ------------------------------------------------------------------ reading

    def batches(self) -> Iterator[CapacityClass]:
        """Classes with members, float ones then int8 ones, each narrowest first: one graph call
        each per decode step."""
        for classes in self.kinds.values():
            for capacity in sorted(classes):
                if classes[capacity].members:
                    yield classes[capacity]

    def members(self) -> list[str]:
        return [sequence for klass in self.batches() for sequence in klass.members]

    def rewind(self, tokens: int) -> None:
        """Take back every member's last `tokens` tokens (benchmarks measure steps at a fixed context)."""
        for klass in self.batches():
            klass.rewind(tokens)

    def holders(self) -> list[str]:
        return list(self.capacity_of)

    def length(self, sequence_id: str) -> int:
        klass = self._class_of(sequence_id)
        assert klass is not None, f"sequence {sequence_id!r} holds no row"
        return int(klass.lengths[klass.members.index(sequence_id)])

    def held_bytes(self) -> dict[str, int]:
        """Bytes each sequence holds or is promised (its tokens in whole blocks of its storage kind):
        the engine sums them by cache-policy form for the `policy` label."""
        blocks = {sequence: -(-tokens // self.block_size) for sequence, tokens in self.tokens.items()}
        return {
            sequence: count * self.block_size * self.layout.kind_token_bytes(self.kind_of[sequence])
            for sequence, count in blocks.items()
        }

    def stats(self) -> StoreStats:
        return StoreStats(
            used_tokens=sum(self.tokens.values()),
            used_bytes=sum(self.held_bytes().values()),
            physical_bytes=self.physical_bytes,
            peak_physical_bytes=self.peak_physical_bytes,
            capacity_bytes=self.capacity_bytes,
            sequences=len(self.capacity_of),
            classes=len(self.all_classes()),
        )
