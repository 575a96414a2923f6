"""One thread's memory for a host array it makes call after call, handed out again only once
nothing refers to the last one.

The engine core pins glibc's mmap threshold at 256 KB (service/malloc.py, so that freed batch
caches go back to the system), so every larger array is a fresh mapping whose pages fault in as
they are first written: assembling a prefix-cache hit's 1,600-token past (6.5 MB) took 2.6 ms
that way against 0.2 ms in memory already mapped. A hit's assembled past is handed to the engine
thread inside its PrefilledPrompt, which copies it into the request's row and the prefix cache's
blocks and then drops it; the memory is reused only when no array refers to it any more (numpy
views keep a reference to the memory they view), so it is never written while still read.
"""

from __future__ import annotations

import math
import sys

import numpy as np

MAX_REUSED_BYTES = 8 << 20  # a larger array is made afresh each time (a 2,048-token past at 4 KiB a token)


class ScratchArray:
    """Reused host memory for arrays of varying shape, up to MAX_REUSED_BYTES; used by one thread."""

    def __init__(self) -> None:
        self._memory: np.ndarray | None = None  # flat; the arrays handed out view it

    def empty(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """An uninitialised C-contiguous array of `shape`: the kept memory if it is free and large
        enough, else new memory (kept for next time when within MAX_REUSED_BYTES)."""
        wanted = np.dtype(dtype)
        size = math.prod(shape)
        if size * wanted.itemsize > MAX_REUSED_BYTES:
            return np.empty(shape, dtype=wanted)
        memory = None if self.in_use else self._memory
        if memory is None or memory.dtype != wanted or memory.size < size:
            memory = self._memory = np.empty(size, dtype=wanted)
        return memory[:size].reshape(shape)

    @property
    def in_use(self) -> bool:
        """Whether an array handed out still refers to the kept memory: free, it has two references
        (the attribute and getrefcount's argument), and every live view adds one."""
        return self._memory is not None and sys.getrefcount(self._memory) > 2
