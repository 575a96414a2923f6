"""Capacity classes: dense in-place batches of rows of one width, on a geometric ladder of widths.

A class of capacity C is one array (2 x layers, rows, heads, C, head_dim) that the serving graph
reads in place; each row is one sequence, left-aligned (token i at column i) with its own length,
unused columns masked. The capacities form a geometric ladder (x GROWTH, in whole blocks): a
sequence that fills its row moves to a row of the next class (one copy of its own cache), so a row
is at least ~80% used and a short sequence never pays for a long one's width, as it would in one
left-padded batch.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from service.engine.kv.arrays import Array, Backend
from service.engine.kv.layout import KVLayout
from service.engine.kv.local import LocalRows
from service.engine.kv.rows import Rows, SplitKV, make_rows
from service.engine.kv.spec import RowEviction

GROWTH = 1.25  # capacity ratio between neighbouring classes: a row is >= 1/GROWTH full
SMALLEST_CLASS_BLOCKS = 4
_VERSIONS = itertools.count()  # binding versions, unique across re-made classes


def capacity_ladder(max_tokens: int, block_size: int) -> list[int]:
    """Row capacities in tokens: whole blocks, x GROWTH apart, the last one exactly `max_tokens`."""
    ladder: list[int] = []
    capacity = SMALLEST_CLASS_BLOCKS * block_size
    while capacity < max_tokens:
        ladder.append(capacity)
        capacity = max(capacity + block_size, -(-math.ceil(capacity * GROWTH) // block_size) * block_size)
    ladder.append(max_tokens)
    return ladder


def rotate_keys(backend: Backend, keys: Array, offset: int, inv_freq: np.ndarray, dtype: str) -> Array:
    """RoPE keys (..., head_dim) moved `offset` positions later: a pure rotation by offset x inv_freq
    (the YaRN attention factor they carry is kept, not applied twice)."""
    angles = offset * inv_freq  # float64: exact up to fp32 rounding at any offset
    emb = np.concatenate((angles, angles))
    cos, sin = backend.upload(np.cos(emb).astype(dtype)), backend.upload(np.sin(emb).astype(dtype))
    half = keys.shape[-1] // 2
    rotated_half = backend.concatenate([-keys[..., half:], keys[..., :half]], axis=-1)
    return keys * cos + rotated_half * sin


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
        reserve_bytes: int = 0,
        storage: Rows | None = None,
        local: LocalRows | None = None,
    ) -> None:
        """`reserve_bytes`: the most its arrays may ever take (the budget), which lets host arrays
        change their row count in place (`resized_from`); `storage`: rows already laid out (that)."""
        self.backend, self.layout, self.capacity = backend, layout, capacity
        self.kind = kind or layout.dtype
        self.spec = layout.storage(self.kind)  # what its rows are and which graphs may read them
        self.rotary_inv_freq = rotary_inv_freq
        self.storage = storage or make_rows(self.kind, backend, layout, rows, capacity, reserve_bytes)
        self.cache = self.storage.cache  # (2 x layers, rows, heads, capacity, head_dim)
        # A hybrid's local layers' K/V (KVLayout.local), bounded by the window: kv/local.py.
        window = layout.local
        self.local = local or (None if window is None else LocalRows(backend, window, rows, capacity, reserve_bytes))
        # mask: (rows, capacity + 1); the last column is the token fed by the step, always 1.
        self.mask = backend.zeros((rows, capacity + 1), "int64")
        self.mask[:, capacity] = 1
        self.positions = backend.zeros((rows, 1), "int64")  # the position the next token is fed at
        self.input_ids = backend.zeros((rows, 1), "int64")
        self.row_index = backend.arange(rows)
        self.lengths = np.zeros(rows, dtype=np.int64)  # cached tokens per row (host: no device reads)
        self.policies: list[RowEviction] = []  # of rows [0, B)
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
        return self.rows * self.layout.row_bytes(self.capacity, self.kind)

    @property
    def free_rows(self) -> int:
        return self.rows - len(self.members) - len(self.reserved)

    @property
    def resizes_in_place(self) -> bool:
        """Its arrays can change their row count where they are (host memory with a reserve; a split
        row's local columns too)."""
        return self.storage.memory.in_place and (self.local is None or self.local.memory.in_place)

    @classmethod
    def resized_from(cls, old: CapacityClass, rows: int) -> CapacityClass:
        """`old` with `rows` rows (at least its members), its arrays changed in place: no second
        array is ever allocated. `old` must not be used afterwards (its arrays' layout is gone)."""
        old.storage.resize(rows, len(old.members))
        if old.local is not None:
            old.local.resize(rows, len(old.members))
        fresh = cls(
            old.backend, old.layout, old.capacity, rows, old.rotary_inv_freq, old.kind,
            storage=old.storage, local=old.local,
        )  # fmt: skip
        fresh.copy_members_from(old, cache=False)
        return fresh

    def copy_members_from(self, old: CapacityClass, cache: bool = True) -> None:
        """Take over `old`'s members and reservations (same capacity, at least as many rows);
        `cache` False: their K/V are already in this class's arrays."""
        batch = len(old.members)
        if cache:
            for new, previous in zip(self.arrays, old.arrays, strict=True):
                new[:, :batch] = previous[:, :batch]
        self.mask[:batch] = old.mask[:batch]
        self.positions[:batch] = old.positions[:batch]
        self.lengths[:batch] = old.lengths[:batch]
        if self.local is not None and old.local is not None and self.local is not old.local:
            self.local.copy_from(old.local, batch, cache)
        self.members, self.reserved, self.uniform = list(old.members), set(old.reserved), old.uniform
        self.policies, self.bounded = list(old.policies), old.bounded

    def write(self, sequence_id: str, kv: Array, length: int, policy: RowEviction | None = None) -> None:
        """A reserved sequence's cache (tensors, heads, length, head_dim), float or this kind's own
        (`row_cache` of a class of this kind), becomes the next member row."""
        policy = policy or RowEviction()
        row = len(self.members)
        if isinstance(kv, SplitKV):
            assert self.local is not None, "a split row's cache goes to a class with local columns"
            self.local.write(row, kv.local_kv)
            kv = kv.global_kv
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
        kv = self.storage.raw((slice(None), row, slice(None), slice(None, int(self.lengths[row]))))
        return kv if self.local is None else SplitKV(kv, self.local.raw(row))

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
            if self.local is not None:
                self.local.move(row, last)
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
        if self.local is not None:
            assert new_kv is None, "split rows decode through the fused graph, which writes their K/V"
            self.local.advance(batch)
        if evicted:
            self._reset_positions()
        else:
            self.positions[:batch] += 1

    def append_tokens(self, row: int, kv: Array) -> None:
        """Write several tokens' K/V, (tensors, heads, n, head_dim), after row `row`'s last: a
        verified speculative block's kept tokens (service.engine.spec). A bounded row takes
        more than one only while they fit its budget; one token into a full bounded row evicts first,
        as `append_step` does."""
        assert self.local is None, "split rows keep their speculative K/V through the fused graph (keep_written)"
        count = int(kv.shape[2])
        policy = self.policies[row]
        evicted = False
        if policy.budget and self.lengths[row] + count > policy.budget:
            assert count == 1, "a block is verified only while it fits the row's budget"
            evicted = self._evict_row(row)
        column = int(self.lengths[row])
        self._put((slice(None), row, slice(None), slice(column, column + count)), kv)
        self.mask[row, column : column + count] = 1
        self.lengths[row] += count
        if evicted:
            self.positions[row, 0] = self.lengths[row] + (policy.evicted if policy.original_positions else 0)
        else:
            self.positions[row, 0] += count
        self._update_uniform()

    def keep_written(self, row: int, count: int, written: int) -> None:
        """A fused call wrote `written` tokens' K/V after full row `row`'s last, in place (a
        speculative block verified there): the first `count` become the row's; the others' columns
        are cleared, so the row holds what a plain run's holds at the same token."""
        assert not self.policies[row].budget, "the fused graph takes full rows only"
        column = int(self.lengths[row])
        if written > count:
            for array in self.arrays:
                array[:, row, :, column + count : column + written] = 0
        self.mask[row, column : column + count] = 1
        self.lengths[row] += count
        self.positions[row, 0] += count
        if self.local is not None:
            self.local.keep(row, count, written)
        self._update_uniform()

    def _evict_row(self, row: int) -> bool:
        """Make room for one token in bounded row `row` (its budget is full)."""
        policy, length = self.policies[row], int(self.lengths[row])
        sinks = policy.sinks
        for array in self.arrays:
            array[:, row, :, sinks : length - 1] = self.backend.copy(array[:, row, :, sinks + 1 : length])
        self.lengths[row] = length - 1
        self.mask[row, length - 1] = 0
        if sinks and self.rotary_inv_freq is not None:
            keys = (slice(0, None, self.layout.per_layer), row, slice(None), slice(None, sinks))
            if policy.anchor is None:  # as stored (INT8: dequantized), before the first move
                policy.anchor = self.backend.copy(self.storage.read(keys))
            self._put(keys, self._rotate(policy.anchor, policy.evicted + 1))
        policy.evicted += 1
        return True

    def _evict_full_rows(self) -> bool:
        """Make room for one token in every bounded row that holds its budget. True if any did."""
        full = [row for row, policy in enumerate(self.policies) if policy.budget and self.lengths[row] >= policy.budget]
        for row in full:
            self._evict_row(row)
        if full:
            self._update_uniform()
        return bool(full)

    def _rotate(self, keys: Array, offset: int) -> Array:
        assert self.rotary_inv_freq is not None
        return rotate_keys(self.backend, keys, offset, self.rotary_inv_freq, self.storage.dtype)

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
        if self.local is not None:
            self.local.rewind(batch, steps)
        for _ in range(steps):
            self.positions[:batch] -= 1
            self.lengths[:batch] -= 1
            self.mask[self.row_index[:batch], self.positions[:batch, 0]] = 0
