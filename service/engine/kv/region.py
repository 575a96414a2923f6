"""Host memory in which a capacity class's array changes its row count in place.

Re-allocating a class into a fresh array holds the old and the new array at once while the members
are copied over, so a class could never grow past about half the budget: at 32 users sharing a
1,536-byte prefix only 16-18 rows fitted in one class, and the rest waited. A `RowRegion` reserves
address space for the whole budget once (an anonymous private mapping: no physical memory until
written) and lays the class's array (tensors, rows, ...) out at its start. A new row count moves
each tensor's member rows to their new offset inside the region (one memmove per tensor, the last
tensor first when growing, the first when shrinking, so no move overwrites rows still to move) and
gives the pages past the new end back to the kernel (MADV_DONTNEED). The physical memory is the
array's own bytes, never old plus new.

Rows past the members hold whatever was there (earlier K/V values: finite floats), as a freed row
does after `CapacityClass.remove`; nothing reads them but the graph's own masked columns.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import numpy as np

from service.engine.kv.arrays import Array, Backend, NumpyArrays

PAGE = mmap.PAGESIZE
# Address space, not memory: the kernel's overcommit accounting leaves it out (Linux's value; the
# mmap module names it from Python 3.13). Under strict overcommit it is ignored and counted.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _numpy_asks_for_huge_pages() -> bool:
    """Whether numpy madvises its large arrays to transparent huge pages (it does on Linux unless
    told not to), so that a class's region gets what a `np.zeros` class array got."""
    try:
        from numpy._core.multiarray import _get_madvise_hugepage  # type: ignore[attr-defined]
    except ImportError:
        return False
    return bool(_get_madvise_hugepage())


class RowRegion:
    """Reserved address space for one array of up to `reserve_bytes`, rows on axis 1."""

    def __init__(self, reserve_bytes: int) -> None:
        self.reserve_bytes = _pages(max(reserve_bytes, 1))
        self._map = mmap.mmap(-1, self.reserve_bytes, flags=mmap.MAP_PRIVATE | MAP_NORESERVE)
        if _numpy_asks_for_huge_pages() and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)  # as numpy's own large arrays: decode steps read it all
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)  # arrays are views of it; it keeps the map
        self._address = int(self._bytes.ctypes.data)

    def _view(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.reserve_bytes:
            raise ValueError(f"an array of {nbytes} bytes exceeds its region's {self.reserve_bytes}")
        return self._bytes[:nbytes].view(dtype).reshape(shape)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """The region's array, zeroed (pages never written read as zero; earlier ones are cleared)."""
        array = self._view(shape, np.dtype(dtype))
        array[...] = 0
        return array

    def resized(self, array: np.ndarray, rows: int, kept: int) -> np.ndarray:
        """`array` (this region's, (tensors, rows', ...)) laid out again with `rows` rows, the first
        `kept` rows of each tensor keeping their values; pages past the new end are released."""
        tensors, old_rows = array.shape[:2]
        assert kept <= min(rows, old_rows) and int(array.ctypes.data) == self._address
        row_bytes = math.prod(array.shape[2:]) * array.itemsize
        order = range(tensors - 1, 0, -1) if rows > old_rows else range(1, tensors)
        for tensor in order:
            destination, source = tensor * rows * row_bytes, tensor * old_rows * row_bytes
            ctypes.memmove(self._address + destination, self._address + source, kept * row_bytes)
        resized = self._view((tensors, rows, *array.shape[2:]), array.dtype)
        start, end = _pages(resized.nbytes), _pages(array.nbytes)
        if start < end:  # the pages the shorter array no longer reaches (they read as zero if touched again)
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        return resized


class RowMemory:
    """Where one class's arrays come from: regions of `reserve_bytes` each on the host (so the class
    can change its row count in place), else the backend's own arrays (a device's, or no reserve)."""

    def __init__(self, backend: Backend, reserve_bytes: int = 0) -> None:
        self.backend = backend
        self.in_place = reserve_bytes > 0 and isinstance(backend, NumpyArrays)
        self._reserve_bytes = reserve_bytes
        self._regions: list[RowRegion] = []

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Array:
        if self.in_place:
            try:
                region = RowRegion(self._reserve_bytes)
            except OSError:  # no address space to reserve (strict overcommit): this class grows by copy
                self.in_place = False
            else:
                self._regions.append(region)
                return region.zeros(shape, dtype)
        return self.backend.zeros(shape, dtype)

    def resized(self, arrays: list[Array], rows: int, kept: int) -> list[Array]:
        """The arrays `zeros` made, in order, with `rows` rows in place (`in_place` only)."""
        assert self.in_place and len(arrays) == len(self._regions)
        return [region.resized(array, rows, kept) for region, array in zip(self._regions, arrays, strict=True)]
