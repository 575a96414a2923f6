"""A hybrid's rows keep the local layers' K/V in a window's columns: the memory, the accounting and the
budget count what is held (no ONNX Runtime here)."""

from __future__ import annotations

import numpy as np

from contract.kv_spec import LayerCacheSpec
from service.engine.kv import KVLayout, KVStore, SplitKV, sliding_window
from service.engine.kv.prefix import block_hashes
from service.engine.request import Request, SamplingParams
from service.engine.sched.scheduler import Scheduler

BLOCK = 16
WINDOW = 64
# The shipped models' shape: 4 layers of 4 heads of 32, layers 0-2 local.
ROPE = KVLayout(n_layers=4, n_heads=4, head_dim=32, dtype="float32")
CACHE = LayerCacheSpec.full(4, 32)


def hybrid(local_layers: tuple[int, ...], block: int = BLOCK) -> KVLayout:
    """The shipped shape with `local_layers` kept apart, a window of WINDOW."""
    return KVLayout(4, 4, 32, "float32", local=sliding_window(local_layers, WINDOW, block, CACHE, "float32"))


HYBRID = hybrid((0, 1, 2))
LOCAL_WIDTH = HYBRID.local.width if HYBRID.local else 0


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
    kv = split_kv(300, LOCAL_WIDTH)
    store.write("b", kv, 300)
    klass = next(klass for klass in store.batches() if "b" in klass.members)
    row = klass.members.index("b")
    assert klass.local is not None and int(klass.local.lengths[row]) == WINDOW - 1
    np.testing.assert_array_equal(klass.local.raw(row), kv.local_kv[:, :, -(WINDOW - 1) :])


def test_full_local_columns_shift_back_to_the_window_after_a_step() -> None:
    store = KVStore(HYBRID, 1 << 26, BLOCK, 4096)
    assert store.reserve("a", 400)
    store.write("a", split_kv(300, LOCAL_WIDTH - 1), 300)
    klass = next(store.batches())
    assert klass.local is not None
    before = klass.local.cache[:, 0, :, LOCAL_WIDTH - WINDOW + 1 :].copy()
    klass.local.cache[:, 0, :, LOCAL_WIDTH - 1] = -1.0  # what the fused kernel writes at the row's length
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
    assert 0 < local_blocks <= LOCAL_WIDTH // BLOCK
    global_bytes = len(hashes) * BLOCK * HYBRID.token_bytes
    assert store.prefix.nbytes == global_bytes + local_blocks * BLOCK * 6 * 4 * 32 * 4
    past = store.cached_past(tokens, hashes, extra, 999)
    assert past is not None and past.tokens == 992 and past.local_tokens == WINDOW - 1
    local = past.assemble_local()
    np.testing.assert_array_equal(local[:, 0], kv.local_kv[:, :, 992 - 1000 + 144 - (WINDOW - 1) : 992 - 1000 + 144])
    assert store.peek_cached(tokens, hashes, extra) == 992
    # A prompt sharing only the first blocks, whose local K/V were not kept: the hit takes their global
    # K/V and has the window recomputed (3 local layers x 63 tokens), in admission's estimate too.
    other = tokens[:500] + [5] * 100
    other_hashes = block_hashes(other, BLOCK, extra)
    past = store.cached_past(other, other_hashes, extra, 599)
    assert past is not None and past.tokens == 496 and past.local_parts is None and past.repair == 189
    assert store.peek_cached(other, other_hashes, extra) == 496
    # Without that rule (a global layer below a local one) the hit steps back to a held window: none here.
    interleaved = hybrid((0, 2, 3))
    assert interleaved.repair_tokens == 0 and HYBRID.repair_tokens == 189
    store = KVStore(interleaved, 1 << 26, BLOCK, 4096)
    store.cache_prompt(tokens, hashes, extra, kv, "full")
    assert store.cached_past(other, other_hashes, extra, 599) is None


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


def test_a_short_row_never_holds_more_local_columns_than_tokens() -> None:
    """A class narrower than `local_width` gives its rows as many local columns as it has tokens: a
    hybrid's short row costs no more than rope's."""
    rope, hybrid = KVStore(ROPE, 1 << 26, BLOCK, 4096), KVStore(HYBRID, 1 << 26, BLOCK, 4096)
    for store in (rope, hybrid):
        assert store.reserve("a", 20)
    assert allocated(hybrid) == hybrid.physical_bytes <= allocated(rope)
    klass = next(iter(hybrid.all_classes()))
    assert klass.capacity == 64 and klass.local is not None and klass.local.width == 64


def test_rows_narrower_than_the_window_keep_every_token_s_local_k_v_across_moves() -> None:
    """Classes narrower than the window never shift: a full row moves up with all its local K/V, and
    decoding on through wider classes (where it shifts) keeps exactly the last tokens, in order."""
    layout = hybrid((0, 1, 2), block=4)
    store = KVStore(layout, 1 << 28, 4, 4096)
    assert store.ladder[0] == 16  # narrower than the window

    def kv(start: int, stop: int) -> SplitKV:
        values = np.arange(start, stop, dtype=np.float32)[None, None, :, None]
        shape = (4, stop - start, 32)
        return SplitKV(np.broadcast_to(values, (2, *shape)).copy(), np.broadcast_to(values, (6, *shape)).copy())

    assert store.reserve("a", 11)
    store.write("a", kv(0, 10), 10)
    for token in range(10, 300):  # each step: room for the token, the kernel's write, the store's advance
        assert store.reserve("a", token + 1)
        klass = next(store.batches())
        assert klass.local is not None
        column = int(klass.local.lengths[0])
        assert column < klass.local.width
        klass.local.cache[:, 0, :, column] = token
        klass.append_step(None)
        last = min(token + 1, WINDOW - 1)  # the window the next token's local layers attend to
        np.testing.assert_array_equal(klass.local.raw(0)[0, 0, -last:, 0], np.arange(token + 1)[-last:])
