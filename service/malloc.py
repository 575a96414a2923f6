"""glibc malloc settings both processes apply at start (the front end and the engine core)."""

from __future__ import annotations

import ctypes


def return_freed_memory_to_the_os() -> None:
    """Pin glibc's mmap threshold and cap its arenas. Batch caches are large arrays whose size
    changes as sequences come and go; with the default dynamic threshold freed ones stay in
    per-thread heaps and resident memory creeps up under churn (docs/measurements.md). No-op
    where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold, m_arena_max = -3, -8  # from glibc's malloc.h
    mallopt(m_mmap_threshold, 256 * 1024)
    mallopt(m_arena_max, 4)
