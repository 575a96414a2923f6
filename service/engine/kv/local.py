"""A capacity class's local columns: a hybrid model's sliding-window layers' K/V, bounded by the window.

A local layer attends to its last `window` tokens (its query's own included), so a row keeps at most
`local_width` of its local layers' K/V (fewer in a class narrower than that: `KVLayout.local_columns`),
left-aligned like the global columns (the fused kernel writes each new token at column `length` and
finds the window by column), whatever the sequence's length.
RoPE keys are stored rotated at their true positions, so a shift moves columns, never positions: the
query is fed at its true position and the kernel's causal window by column is the window by token.
When a row's local columns are full it shifts its last `window - 1` tokens to the front: one copy of
the window every `local_width - window + 1` steps. Speculative guesses are written after a row's
last column and kept or cleared by `keep` (a guess rejected never stays).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.engine.kv.arrays import Array, Backend
from service.engine.kv.region import RowMemory
from service.engine.kv.spec import SlidingWindowSpec


class LocalRows:
    """The local layers' K/V of a class's rows, (2 x local layers, rows, heads, local_width, head_dim),
    with their own mask (rows, local_width + 1; the last column is the step's token) and lengths."""

    def __init__(
        self, backend: Backend, spec: SlidingWindowSpec, rows: int, capacity: int, reserve_bytes: int = 0
    ) -> None:
        """The local columns of rows of `capacity` tokens (`SlidingWindowSpec.columns`). A class narrower
        than the window never shifts: its rows' local columns fill only as their global ones do, and a
        full row moves to a wider class, its local K/V with it, before its next step."""
        self.backend, self.spec = backend, spec
        self.width, self.keep_tokens = spec.columns(capacity), spec.keep_tokens
        self.shifts = self.width > self.keep_tokens
        self.memory = RowMemory(backend, reserve_bytes)
        shape = (spec.tensors, rows, spec.cache.heads, self.width, spec.cache.width)
        self.cache = self.memory.zeros(shape, spec.dtype)
        self.mask = backend.zeros((rows, self.width + 1), "int64")
        self.mask[:, self.width] = 1
        self.lengths = np.zeros(rows, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.shape[0]) * self.width * self.spec.token_bytes

    def resize(self, rows: int, kept: int) -> None:
        """Its array laid out again with `rows` rows in place (host memory with a reserve), masks and lengths alike."""
        (self.cache,) = self.memory.resized([self.cache], rows, kept)
        mask = self.backend.zeros((rows, self.width + 1), "int64")
        mask[:, self.width] = 1
        mask[:kept] = self.mask[:kept]
        lengths = np.zeros(rows, dtype=np.int64)
        lengths[:kept] = self.lengths[:kept]
        self.mask, self.lengths = mask, lengths

    def copy_from(self, old: LocalRows, batch: int, cache: bool = True) -> None:
        if cache:
            self.cache[:, :batch] = old.cache[:, :batch]
        self.mask[:batch] = old.mask[:batch]
        self.lengths[:batch] = old.lengths[:batch]

    def write(self, row: int, kv: Array) -> None:
        """A row's local K/V, (2 x local layers, heads, m, head_dim), the sequence's last m tokens:
        the last `width - 1` at most are kept (room for the next token)."""
        count = int(kv.shape[2])
        if count >= self.width and self.shifts:
            kv, count = kv[:, :, count - self.keep_tokens :], self.keep_tokens
        assert count <= self.width, "a row's local K/V never outnumber its tokens"
        self.cache[:, row, :, :count] = kv
        self._set_length(row, count)

    def raw(self, row: int) -> Array:
        return self.cache[:, row, :, : int(self.lengths[row])]

    def move(self, row: int, last: int) -> None:
        """Row `last` takes row `row`'s place (a member left)."""
        self.cache[:, row] = self.cache[:, last]
        self.mask[row] = self.mask[last]
        self.lengths[row] = self.lengths[last]

    def _set_length(self, row: int, length: int) -> None:
        self.mask[row, : self.width] = 0
        self.mask[row, :length] = 1
        self.lengths[row] = length

    def make_room(self, row: int, tokens: int) -> None:
        """Shift the row back to its last `window - 1` tokens if `tokens` more would not fit after them."""
        length = int(self.lengths[row])
        if length + tokens <= self.width or length <= self.keep_tokens or not self.shifts:
            return
        start = length - self.keep_tokens
        self.cache[:, row, :, : self.keep_tokens] = self.backend.copy(self.cache[:, row, :, start:length])
        self._set_length(row, self.keep_tokens)

    def advance(self, batch: int, count: Any = 1) -> None:
        """The step's token(s) were written at each row's length (by the fused kernel): count them,
        then shift the rows that are full, so the next step has a column."""
        rows = self.backend.arange(batch)
        self.mask[rows, self.backend.upload(self.lengths[:batch])] = 1
        self.lengths[:batch] += count
        for row in np.flatnonzero(self.lengths[:batch] >= self.width):
            self.make_room(int(row), 1)

    def keep(self, row: int, count: int, written: int) -> None:
        """The kernel wrote `written` tokens after the row's last column (a speculative block): the
        first `count` become the row's, the others' columns are cleared."""
        column = int(self.lengths[row])
        if written > count:
            self.cache[:, row, :, column + count : column + written] = 0
        self.mask[row, column : column + count] = 1
        self.lengths[row] = column + count
        self.make_room(row, 1)

    def rewind(self, batch: int, steps: int) -> None:
        """Take back the last `steps` tokens of every row (benchmarks; as long as none shifted meanwhile)."""
        for _ in range(steps):
            self.lengths[:batch] -= 1
            self.mask[self.backend.arange(batch), self.backend.upload(self.lengths[:batch])] = 0
