"""The KV store: the one owner of a model's K/V memory, sized by the budget the scheduler admits against.

Sequences live in dense in-place batches by capacity class. A class of capacity C is one array
(2 x layers, rows, heads, C, head_dim) that the serving graph reads in place; each row is one
sequence, left-aligned (token i at column i) with its own length, unused columns masked. The
capacities form a geometric ladder (x1.25, in whole blocks): a sequence that fills its row moves
to a row of the next class (one copy of its own cache), so a row is always at least ~80% used
and a short sequence never pays for a long one's width, as it did in one left-padded batch.

Accounting and memory are the same thing here: `reserve` allocates the row (or grows the class
array) at once, or says no, and refuses anything that would take the allocated bytes, counted
with the old array still alive while a class is re-allocated, above the budget. Rows are written
on the array's own device (numpy on the host, or torch tensors on CPU or CUDA, bound to ONNX
Runtime by data pointer), so joins, moves, leaves and each step's new column never cross the bus.

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

from contract.manifest import DTYPE_BYTES

Array = Any  # np.ndarray or torch.Tensor, as the backend makes them

GROWTH = 1.25  # capacity ratio between neighbouring classes: a row is >= 1/GROWTH full
SMALLEST_CLASS_BLOCKS = 4
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


class TorchArrays:
    """torch tensors on a device (CUDA in production; CPU in CI, to run the GPU path's code),
    bound to ONNX Runtime by data pointer as Hugging Face Optimum's ONNX Runtime models do."""

    def __init__(self, device: str = "cpu") -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.device_type = self.device.type
        self.device_id = self.device.index or 0
        self._dtypes = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64}

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


Backend = NumpyArrays | TorchArrays


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
    """One dense in-place batch: rows of `capacity` token columns, members in rows [0, B)."""

    def __init__(
        self, backend: Backend, layout: KVLayout, capacity: int, rows: int, rotary_inv_freq: np.ndarray | None = None
    ) -> None:
        self.backend, self.layout, self.capacity = backend, layout, capacity
        self.rotary_inv_freq = rotary_inv_freq
        self.cache = backend.zeros((layout.tensors, rows, layout.n_heads, capacity, layout.head_dim), layout.dtype)
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
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        return self.rows * self.capacity * self.layout.token_bytes

    @property
    def free_rows(self) -> int:
        return self.rows - len(self.members) - len(self.reserved)

    def copy_members_from(self, old: CapacityClass) -> None:
        """Take over `old`'s members and reservations (same capacity, at least as many rows)."""
        batch = len(old.members)
        self.cache[:, :batch] = old.cache[:, :batch]
        self.mask[:batch] = old.mask[:batch]
        self.positions[:batch] = old.positions[:batch]
        self.lengths[:batch] = old.lengths[:batch]
        self.members, self.reserved, self.uniform = list(old.members), set(old.reserved), old.uniform
        self.policies, self.bounded = list(old.policies), old.bounded

    def write(self, sequence_id: str, kv: Array, length: int, policy: RowPolicy | None = None) -> None:
        """A reserved sequence's cache (tensors, heads, length, head_dim) becomes the next member row."""
        policy = policy or RowPolicy()
        row = len(self.members)
        self.cache[:, row, :, :length] = kv
        self.mask[row, : self.capacity] = 0
        self.mask[row, :length] = 1
        self.positions[row, 0] = length + (policy.evicted if policy.original_positions else 0)
        self.lengths[row] = length
        self.reserved.discard(sequence_id)
        self.members.append(sequence_id)
        self.policies.append(policy)
        self._changed()

    def row_cache(self, row: int) -> Array:
        return self.cache[:, row, :, : int(self.lengths[row])]

    def remove(self, sequence_id: str) -> None:
        """A member leaves: the last row moves into its place (one row's copy)."""
        row = self.members.index(sequence_id)
        last = len(self.members) - 1
        if row != last:
            self.cache[:, row] = self.cache[:, last]
            self.mask[row] = self.mask[last]
            self.positions[row] = self.positions[last]
            self.lengths[row] = self.lengths[last]
            self.members[row] = self.members[last]
            self.policies[row] = self.policies[last]
        self.members.pop()
        self.policies.pop()
        self._changed()

    def _changed(self) -> None:
        batch = len(self.members)
        self.uniform = batch == 0 or bool((self.lengths[:batch] == self.lengths[0]).all())
        self.bounded = any(policy.budget for policy in self.policies)
        self.version = next(_VERSIONS)

    def append_step(self, new_kv: Array) -> None:
        """Write the step's new K/V, (tensors, B, heads, 1, head_dim), at each member's length,
        after evicting from the rows whose policy's budget is full."""
        batch = len(self.members)
        evicted = self._evict_full_rows() if self.bounded else False
        if self.uniform:
            column = int(self.lengths[0])
            self.cache[:, :batch, :, column] = new_kv[:, :, :, 0]
            self.mask[:batch, column] = 1
        else:
            rows, columns = self.row_index[:batch], self.backend.upload(self.lengths[:batch])
            self.cache[:, rows, :, columns] = self.backend.rows_first(new_kv[:, :, :, 0])
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
            self.cache[:, row, :, sinks : length - 1] = self.backend.copy(self.cache[:, row, :, sinks + 1 : length])
            self.lengths[row] = length - 1
            if sinks and self.rotary_inv_freq is not None:
                if policy.anchor is None:
                    policy.anchor = self.backend.copy(self.cache[0::2, row, :, :sinks])
                self.cache[0::2, row, :, :sinks] = self._rotate(policy.anchor, policy.evicted + 1)
            policy.evicted += 1
        if full:
            batch = len(self.members)
            self.uniform = bool((self.lengths[:batch] == self.lengths[0]).all())
        return bool(full)

    def _rotate(self, keys: Array, offset: int) -> Array:
        """RoPE keys moved `offset` positions later: a pure rotation by offset x inv_freq (the
        YaRN attention factor they carry is kept, not applied twice)."""
        assert self.rotary_inv_freq is not None
        angles = offset * self.rotary_inv_freq  # float64: exact up to fp32 rounding at any offset
        emb = np.concatenate((angles, angles))
        dtype = self.layout.dtype
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
        self.classes: dict[int, CapacityClass] = {}
        self.capacity_of: dict[str, int] = {}  # sequence -> the capacity of its class
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

    # ------------------------------------------------------------------ accounting = allocation

    def reserve(self, sequence_id: str, tokens: int) -> bool:
        """Make room for `tokens` tokens of the sequence: a row for a new one (written later by
        `write`), a move to a wider class when its row is full. False, with nothing changed, when
        that would take the allocated memory above the budget."""
        if tokens > self.max_tokens:
            return False
        current = self.capacity_of.get(sequence_id)
        if current is not None and current >= tokens:
            self.tokens[sequence_id] = max(tokens, self.tokens.get(sequence_id, 0))
            return True
        target = self.class_for(tokens)
        moving = self.classes.get(current) if current is not None else None
        # Members of the source class as full as this one move this step too: one re-allocation.
        companions = 0
        if moving is not None and sequence_id in moving.members:
            companions = int((moving.lengths[: len(moving.members)] >= moving.capacity).sum()) - 1
        destination = self._room(target, 1 + max(companions, 0))
        if destination is None:
            self.trim(all_spare=True)
            destination = self._room(target, 1 + max(companions, 0))
            if destination is None:
                return False
        destination.reserved.add(sequence_id)
        source = self.classes.get(current) if current is not None else None  # trim may have re-made it
        if source is not None:
            if sequence_id in source.members:  # a move: the row's cache goes with it, on the device
                row = source.members.index(sequence_id)
                destination.write(sequence_id, source.row_cache(row), int(source.lengths[row]), source.policies[row])
                source.remove(sequence_id)
            else:
                source.reserved.discard(sequence_id)
            self._release_if_empty(source)
        self.capacity_of[sequence_id] = target
        self.tokens[sequence_id] = max(tokens, self.tokens.get(sequence_id, 0))
        return True

    def _room(self, capacity: int, rows_needed: int) -> CapacityClass | None:
        """The class with a free row, grown if it must be (`rows_needed` rows are about to be taken):
        with an eighth more rows of headroom if that fits, else exactly."""
        existing = self.classes.get(capacity)
        if existing is not None and existing.free_rows > 0:
            return existing
        held = 0 if existing is None else existing.rows - existing.free_rows
        wanted = held + rows_needed
        for rows in dict.fromkeys((wanted + wanted // 8, wanted, held + 1)):
            grown = self._reallocate(capacity, rows)
            if grown is not None:
                return grown
        return None

    def _reallocate(self, capacity: int, rows: int) -> CapacityClass | None:
        """A new array for the class with `rows` rows, members copied over; None if the old and the
        new array together would exceed the budget."""
        old = self.classes.get(capacity)
        new_bytes = rows * capacity * self.layout.token_bytes
        if self.physical_bytes + new_bytes > self.capacity_bytes:
            return None
        self.peak_physical_bytes = max(self.peak_physical_bytes, self.physical_bytes + new_bytes)
        fresh = CapacityClass(self.backend, self.layout, capacity, rows, self.rotary_inv_freq)
        if old is not None:
            fresh.copy_members_from(old)
            self.physical_bytes -= old.nbytes
        self.classes[capacity] = fresh
        self.physical_bytes += fresh.nbytes
        return fresh

    def _release_if_empty(self, klass: CapacityClass) -> None:
        if not klass.members and not klass.reserved:
            self.physical_bytes -= klass.nbytes
            del self.classes[klass.capacity]

    def trim(self, all_spare: bool = False) -> None:
        """Give back spare rows where more than a quarter of a class is spare (`all_spare`: every
        spare row, when memory ran out), if the copy fits beside the old array."""
        for klass in list(self.classes.values()):
            held = klass.rows - klass.free_rows
            if all_spare and held and klass.free_rows:
                self._reallocate(klass.capacity, held)
            elif held and klass.free_rows > max(1, klass.rows // 4):
                self._reallocate(klass.capacity, held + held // 8)

    def free(self, sequence_id: str) -> None:
        """The sequence is done (finished, aborted or preempted): its row is free at once."""
        capacity = self.capacity_of.pop(sequence_id, None)
        self.tokens.pop(sequence_id, None)
        klass = self.classes.get(capacity) if capacity is not None else None
        if klass is None:
            return
        if sequence_id in klass.members:
            klass.remove(sequence_id)
        klass.reserved.discard(sequence_id)
        self._release_if_empty(klass)

    def write(self, sequence_id: str, kv: Array, length: int, policy: RowPolicy | None = None) -> None:
        """A prefilled prompt's cache, (tensors, heads, length, head_dim), into its reserved row."""
        capacity = self.capacity_of.get(sequence_id)
        if capacity is None or sequence_id not in self.classes[capacity].reserved:
            raise KeyError(f"sequence {sequence_id!r} holds no reserved row")
        if length > capacity:
            raise ValueError(f"sequence {sequence_id!r}: {length} tokens exceed its row of {capacity}")
        self.classes[capacity].write(sequence_id, kv, length, policy)

    # ------------------------------------------------------------------ reading

    def batches(self) -> Iterator[CapacityClass]:
        """Classes with members, narrowest first: one graph call each per decode step."""
        for capacity in sorted(self.classes):
            if self.classes[capacity].members:
                yield self.classes[capacity]

    def members(self) -> list[str]:
        return [sequence for klass in self.batches() for sequence in klass.members]

    def rewind(self, tokens: int) -> None:
        """Take back every member's last `tokens` tokens (benchmarks measure steps at a fixed context)."""
        for klass in self.batches():
            klass.rewind(tokens)

    def holders(self) -> list[str]:
        return list(self.capacity_of)

    def length(self, sequence_id: str) -> int:
        klass = self.classes[self.capacity_of[sequence_id]]
        return int(klass.lengths[klass.members.index(sequence_id)])

    def stats(self) -> StoreStats:
        used_blocks = sum(-(-tokens // self.block_size) for tokens in self.tokens.values())
        return StoreStats(
            used_tokens=sum(self.tokens.values()),
            used_bytes=used_blocks * self.block_bytes,
            physical_bytes=self.physical_bytes,
            peak_physical_bytes=self.peak_physical_bytes,
            capacity_bytes=self.capacity_bytes,
            sequences=len(self.capacity_of),
            classes=len(self.classes),
        )
