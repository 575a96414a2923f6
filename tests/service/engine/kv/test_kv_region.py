"""Host classes change their row count in place: their K/V survive, and the physical memory (the
process's resident set, not the store's count) never holds an old and a new array at once."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from contract.paths import REPOSITORY_ROOT
from service.engine.kv import KVLayout
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


MEASURE = """
import json, sys
from pathlib import Path
import numpy as np
from service.engine.kv import KVLayout, KVStore

MiB = 1 << 20
layout = KVLayout(n_layers=2, n_heads=4, head_dim=32, dtype="float32")  # 2,048 bytes per token
capacity = 1024  # tokens: a row of 2 MiB

def status(field):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

def resident():
    return status("VmRSS")

def peak():
    return status("VmHWM")

store = KVStore(layout, 64 * MiB, 16, capacity)
row_kv = np.ones((layout.tensors, layout.n_heads, capacity, layout.head_dim), dtype=np.float32)
Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from now
before = resident()
names = []
while store.reserve(name := f"s{len(names)}", capacity):
    store.write(name, row_kv, capacity)  # every page of the row written
    names.append(name)
klass = store.classes[capacity]
out = {"rows": klass.rows, "members": len(names), "class_bytes": klass.nbytes, "store_peak": store.peak_physical_bytes,
       "kept": float(klass.cache[:, : len(names)].min()), "grown": resident() - before, "peak": peak() - before}
del klass  # the class as it was: its arrays would keep the region mapped
for name in names[8:]:
    store.free(name)
store.trim(all_spare=True)  # the class shrinks in place to its 8 members
out["trimmed_rows"] = store.classes[capacity].rows
out["trimmed_kept"] = float(store.classes[capacity].cache[:, :8].min())
out["after_trim"] = resident() - before
for name in names[:8]:
    store.free(name)
out["physical_after_free"] = store.physical_bytes
out["after_free"] = resident() - before
print(json.dumps(out))
"""


@pytest.mark.server  # runs a subprocess
def test_a_class_grows_past_half_the_budget_and_gives_its_pages_back() -> None:
    """In a process of its own (nothing else allocating beside it): the kernel's resident set and peak."""
    result = subprocess.run(
        [sys.executable, "-c", MEASURE], cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    budget, row = 64 * MiB, CAPACITY * LAYOUT.token_bytes
    # One class took nearly the whole budget (a copy beside the old array stopped at half of it) ...
    assert out["rows"] == out["members"] >= 28 and out["class_bytes"] > 0.85 * budget
    assert out["kept"] == 1.0  # every member's K/V survived each move
    # ... and the process never held much more than that at once (the store's peak is its count).
    assert out["class_bytes"] - 4 * MiB <= out["grown"] <= out["class_bytes"] + 4 * MiB
    assert out["peak"] <= out["store_peak"] + 8 * MiB < 1.2 * out["class_bytes"]
    assert out["trimmed_rows"] == 8 and out["trimmed_kept"] == 1.0
    assert out["after_trim"] <= 8 * row + 4 * MiB
    assert out["physical_after_free"] == 0 and out["after_free"] <= 4 * MiB
