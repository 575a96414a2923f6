"""Host classes change their row count in place: their K/V survive, and the physical memory (the
process's resident set, not the store's count) never holds an old and a new array at once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.engine.kv import KVLayout, KVStore
from service.engine.kv.region import RowRegion

MiB = 1 << 20
LAYOUT = KVLayout(n_layers=2, n_heads=4, head_dim=32, dtype="float32")  # 2,048 bytes per token
CAPACITY = 1024  # tokens: a row of 2 MiB


@pytest.mark.parametrize("rows", [[3, 7, 16, 5, 2, 9], [1, 2, 3, 4], [8, 1, 8]])
def test_resized_rows_keep_the_members_k_v_in_every_tensor(rows: list[int]) -> None:
    rng = np.random.default_rng(0)
    shape = (4, rows[0], 2, 5, 3)
    region = RowRegion(4 * max(rows) * 2 * 5 * 3 * 4)
    array = region.zeros(shape, "float32")
    array[...] = rng.standard_normal(shape)
    expected = array.copy()
    for count in rows[1:]:
        kept = min(count, array.shape[1]) - (1 if count > 1 else 0)  # the last row left out: free
        array = region.resized(array, count, kept)
        assert array.shape == (4, count, 2, 5, 3) and array.flags.c_contiguous
        np.testing.assert_array_equal(array[:, :kept], expected[:, :kept])
        expected = array.copy()


def resident_bytes() -> int:
    """This process's resident set, from the kernel."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def peak_resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_class_grows_past_half_the_budget_and_gives_its_pages_back() -> None:
    budget = 64 * MiB
    store = KVStore(LAYOUT, budget, 16, CAPACITY)
    row_kv = np.ones((LAYOUT.tensors, LAYOUT.n_heads, CAPACITY, LAYOUT.head_dim), dtype=np.float32)
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from now
    before = resident_bytes()
    names = []
    while store.reserve(name := f"s{len(names)}", CAPACITY):
        store.write(name, row_kv, CAPACITY)  # every page of the row written
        names.append(name)
    klass = store.classes[CAPACITY]
    # One class took nearly the whole budget (a copy beside the old array stopped at half of it) ...
    assert len(names) == klass.rows >= 28 and klass.nbytes > 0.85 * budget
    assert float(klass.cache[:, : len(names)].min()) == 1.0  # every member's K/V survived each move
    # ... and the process never held much more than that at once (the store's peak is its count).
    grown = resident_bytes() - before
    assert klass.nbytes - 4 * MiB <= grown <= klass.nbytes + 4 * MiB
    assert peak_resident_bytes() - before <= store.peak_physical_bytes + 8 * MiB < 1.2 * klass.nbytes
    del klass  # the class as it was: its arrays would keep the region mapped
    for name in names[8:]:
        store.free(name)
    store.trim(all_spare=True)  # the class shrinks in place to its 8 members
    assert store.classes[CAPACITY].rows == 8 and float(store.classes[CAPACITY].cache[:, :8].min()) == 1.0
    assert resident_bytes() - before <= 8 * CAPACITY * LAYOUT.token_bytes + 4 * MiB
    for name in names[:8]:
        store.free(name)
    assert store.physical_bytes == 0 and CAPACITY not in store.classes
    assert resident_bytes() - before <= 4 * MiB
