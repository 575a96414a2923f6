"""A hybrid's rows keep the local layers' K/V in a window's columns: the memory, the accounting and the
budget count what is held (no ONNX Runtime here)."""

from __future__ import annotations

import numpy as np

from service.engine.kv import KVLayout, KVStore, SplitKV, local_width
from service.engine.kv.prefix import block_hashes
from service.engine.request import Request, SamplingParams
from service.engine.sched.scheduler import Scheduler

BLOCK = 16
WINDOW = 64
# The shipped models' shape: 4 layers of 4 heads of 32, layers 0-2 local.
ROPE = KVLayout(n_layers=4, n_heads=4, head_dim=32, dtype="float32")
HYBRID = KVLayout(4, 4, 32, "float32", local_layers=(0, 1, 2), window=WINDOW, local_width=local_width(WINDOW, BLOCK))


def allocated(store: KVStore) -> int:
    """Bytes of the arrays themselves (global and local), not the store's own count."""
    total = 0
    for klass in store.all_classes():
        total += sum(array.nbytes for array in klass.arrays)
        total += 0 if klass.local is None else klass.local.cache.nbytes
    return total


def split_kv(length: int, local: int, value: float = 1.0) -> SplitKV:
    """A prompt's cache as the hybrid prefill hands it over: global K/V of every token, local of the last ones."""
    global_kv = np.full((2, 4, length, 32), value, dtype=np.float32)
    local_kv = np.arange(6 * 4 * local * 32, dtype=np.float32).reshape(6, 4, local, 32)
    return SplitKV(global_kv, local_kv)


def test_a_4000_token_hybrid_row_allocates_under_0_3_of_a_rope_row() -> None:
    rope, hybrid = KVStore(ROPE, 1 << 30, BLOCK, 4096), KVStore(HYBRID, 1 << 30, BLOCK, 4096)
    assert rope.reserve("r", 4000) and hybrid.reserve("h", 4000)
    rope.write("r", np.zeros((8, 4, 4000, 32), dtype=np.float32), 4000)
    hybrid.write("h", split_kv(4000, 200), 4000)
    assert rope.physical_bytes == allocated(rope) and hybrid.physical_bytes == allocated(hybrid)
    assert allocated(hybrid) <= 0.3 * allocated(rope)
    assert hybrid.stats().used_bytes <= 0.3 * rope.stats().used_bytes
    assert hybrid.peak_physical_bytes <= 0.3 * rope.peak_physical_bytes


def test_one_budget_admits_at_least_three_times_as_many_4kb_hybrid_rows() -> None:
    budget = 8 * KVStore.minimum_budget(ROPE, 4096, BLOCK)

    def admitted(layout: KVLayout) -> int:
        store, count = KVStore(layout, budget, BLOCK, 4096), 0
        while store.reserve(f"s{count}", 4000):
            count += 1
        assert store.physical_bytes == allocated(store) <= store.capacity_bytes
        return count

    rope, hybrid = admitted(ROPE), admitted(HYBRID)
    assert rope >= 1 and hybrid >= 3 * rope


def test_a_split_row_keeps_the_last_window_and_moves_with_its_local_columns() -> None:
    store = KVStore(HYBRID, 1 << 26, BLOCK, 4096)
    assert store.reserve("a", 60)
    store.write("a", split_kv(60, 60), 60)
    klass = store.batches().__next__()
    assert klass.local is not None and int(klass.local.lengths[0]) == 60
    kept = klass.local.cache[:, 0, :, :60].copy()
    assert store.reserve("a", 200)  # a move to a wider class carries the local columns as they are
    moved = next(store.batches())
    assert moved.capacity >= 200 and moved.local is not None
    np.testing.assert_array_equal(moved.local.cache[:, 0, :, :60], kept)
    # A prompt longer than the local columns keeps its last window - 1 tokens.
    assert store.reserve("b", 300)
    kv = split_kv(300, HYBRID.local_width)
    store.write("b", kv, 300)
    klass = next(klass for klass in store.batches() if "b" in klass.members)
    row = klass.members.index("b")
    assert klass.local is not None and int(klass.local.lengths[row]) == WINDOW - 1
    np.testing.assert_array_equal(klass.local.raw(row), kv.local_kv[:, :, -(WINDOW - 1) :])


def test_full_local_columns_shift_back_to_the_window_after_a_step() -> None:
    store = KVStore(HYBRID, 1 << 26, BLOCK, 4096)
    assert store.reserve("a", 400)
    store.write("a", split_kv(300, HYBRID.local_width - 1), 300)
    klass = next(store.batches())
    assert klass.local is not None
    before = klass.local.cache[:, 0, :, HYBRID.local_width - WINDOW + 1 :].copy()
    klass.local.cache[:, 0, :, HYBRID.local_width - 1] = -1.0  # what the fused kernel writes at the row's length
    klass.append_step(None)
    assert int(klass.lengths[0]) == 301 and int(klass.local.lengths[0]) == WINDOW - 1
    np.testing.assert_array_equal(klass.local.cache[:, 0, :, : WINDOW - 2], before[:, :, : WINDOW - 2])
    assert (klass.local.cache[:, 0, :, WINDOW - 2] == -1.0).all()
    assert int(klass.local.mask[0].sum()) == WINDOW  # the window's past and the step's own column


def test_a_rejected_guess_never_stays_in_the_local_columns() -> None:
    store = KVStore(HYBRID, 1 << 26, BLOCK, 4096)
    assert store.reserve("a", 100)
    store.write("a", split_kv(50, 50), 50)
    klass = next(store.batches())
    assert klass.local is not None
    klass.local.cache[:, 0, :, 50:55] = 7.0  # a block of 5 written in place by the verifying call
    klass.keep_written(0, 2, 5)
    assert int(klass.local.lengths[0]) == 52 and (klass.local.cache[:, 0, :, 52:55] == 0).all()
    assert int(klass.local.mask[0, :-1].sum()) == 52


def test_a_prefix_hit_carries_the_local_window_before_it_and_its_blocks_count_global_bytes() -> None:
    store = KVStore(HYBRID, 1 << 26, BLOCK, 4096)
    tokens = list(range(1000))
    extra = ("m", "full")
    hashes = block_hashes(tokens, BLOCK, extra)
    kv = split_kv(1000, 144)
    assert store.cache_prompt(tokens, hashes, extra, kv, "full") == len(hashes)
    local_blocks = sum(block.local is not None for block in store.prefix.blocks.values())
    assert 0 < local_blocks <= HYBRID.local_width // BLOCK
    global_bytes = len(hashes) * BLOCK * HYBRID.token_bytes
    assert store.prefix.nbytes == global_bytes + local_blocks * BLOCK * 6 * 4 * 32 * 4
    past = store.cached_past(tokens, hashes, extra, 999)
    assert past is not None and past.tokens == 992 and past.local_tokens == WINDOW - 1
    local = past.assemble_local()
    np.testing.assert_array_equal(local[:, 0], kv.local_kv[:, :, 992 - 1000 + 144 - (WINDOW - 1) : 992 - 1000 + 144])
    # A prompt sharing only the first blocks: their local K/V were not kept, so no hit (nor in admission's estimate).
    other = tokens[:500] + [5] * 100
    assert store.cached_past(other, block_hashes(other, BLOCK, extra), extra, 599) is None
    assert store.peek_cached(other, block_hashes(other, BLOCK, extra), extra) == 0
    assert store.peek_cached(tokens, hashes, extra) == 992


def test_the_scheduler_admits_three_times_as_many_4kb_hybrid_requests_under_one_budget() -> None:
    """Admission asks the store, whose reservations are its allocations: under the budget that admits
    N concurrent 4,000-token rope requests, at least 3N hybrid ones run at once."""
    budget = 3 * KVStore.minimum_budget(ROPE, 4096, BLOCK)

    def admitted(layout: KVLayout) -> int:
        scheduler = Scheduler(KVStore(layout, budget, BLOCK, 4096), max_batch_size=64, max_queue=64)
        for index in range(40):
            scheduler.add(Request(f"r{index}", "m", [1] * 4000, SamplingParams(max_new_tokens=90), eos_token_id=257))
        return len(scheduler.schedule().admitted)

    rope, hybrid = admitted(ROPE), admitted(HYBRID)
    assert rope >= 1 and hybrid >= 3 * rope, (rope, hybrid)


def test_a_class_of_split_rows_grows_in_place_with_its_local_columns() -> None:
    """On the host a class changes its row count in place (region.py): the local columns too, members kept."""
    store = KVStore(HYBRID, 1 << 28, BLOCK, 4096)
    assert store.reserve("a", 100)
    kv = split_kv(90, 90, 3.0)
    store.write("a", kv, 90)
    first = next(store.batches())
    assert first.resizes_in_place and first.local is not None
    for index in range(12):  # more rows than the class had: it grows, in place
        assert store.reserve(f"s{index}", 100)
        store.write(f"s{index}", split_kv(90, 90, 1.0), 90)
    klass = next(store.batches())
    assert klass.rows > first.rows and klass.local is not None
    np.testing.assert_array_equal(klass.local.raw(klass.members.index("a")), kv.local_kv)
    assert store.physical_bytes == allocated(store)
