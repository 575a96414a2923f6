"""The KV store's accounting is its memory, and the scheduler admits against it (no ONNX Runtime here)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from service.engine.kv import KVBudgetError, KVLayout, KVStore, TorchArrays, capacity_ladder
from service.engine.messages import RequestStatus
from service.engine.request import Request, SamplingParams
from service.engine.sched.scheduler import QueueFullError, Scheduler

LAYOUT = KVLayout(n_layers=1, n_heads=1, head_dim=2, dtype="float32")  # 16 bytes per token


def make_request(request_id: str, prompt_len: int, max_new: int = 10) -> Request:
    return Request(request_id, "m", [1] * prompt_len, SamplingParams(max_new_tokens=max_new), eos_token_id=257)


def allocated(store: KVStore) -> int:
    """Bytes of the arrays themselves, not the store's own count."""
    return sum(klass.cache.nbytes for klass in store.classes.values())


def write(store: KVStore, sequence: str, length: int, value: float = 1.0) -> None:
    store.write(sequence, np.full((2, 1, length, 2), value, dtype=np.float32), length)


def test_ladder_is_whole_blocks_about_a_quarter_apart_ending_at_the_limit() -> None:
    ladder = capacity_ladder(4096, 16)
    assert ladder[0] == 64 and ladder[-1] == 4096
    assert all(c % 16 == 0 for c in ladder)
    assert all(1.1 < b / a <= 1.4 for a, b in itertools.pairwise(ladder))


def test_a_budget_below_one_longest_sequence_is_refused_naming_the_minimum() -> None:
    minimum = KVStore.minimum_budget(LAYOUT, 1000, 16)
    KVStore(LAYOUT, minimum, 16, 1000)
    with pytest.raises(KVBudgetError, match=f"needs at least {minimum} bytes"):
        KVStore(LAYOUT, minimum - 16 * 16, 16, 1000)


def test_rows_are_the_memory_and_sequences_move_to_wider_classes_with_their_cache() -> None:
    store = KVStore(LAYOUT, 1 << 20, 16, 1000)
    assert store.reserve("a", 11) and store.reserve("b", 50)
    assert store.physical_bytes == allocated(store) == 64 * 16 * (2 + 2 // 8)  # one class of 64, 2 rows
    write(store, "a", 10, 1.0)
    write(store, "b", 49, 2.0)
    assert store.members() == ["a", "b"]
    assert store.reserve("b", 64)  # still fits its row
    klass = store.classes[64]
    klass.lengths[1] = klass.positions[1, 0] = 64  # as if b decoded 15 tokens
    assert store.reserve("b", 65)  # full: moves to the next class, cache and all
    wider = store.classes[80]
    assert wider.members == ["b"] and int(wider.lengths[0]) == 64
    assert np.all(wider.cache[:, 0, :, :49] == 2.0) and np.all(wider.mask[0, :64] == 1)
    assert np.all(wider.mask[0, 64:80] == 0) and wider.mask[0, 80] == 1
    assert store.classes[64].members == ["a"] and np.all(store.classes[64].cache[:, 0, :, :10] == 1.0)
    assert store.physical_bytes == allocated(store)
    store.free("a")
    store.free("b")
    assert store.classes == {} and store.physical_bytes == 0 and store.stats().used_bytes == 0


def test_a_sequence_whose_rung_is_empty_joins_the_populated_rung_above_it() -> None:
    """Each class with rows is one graph call per step: a sequence goes one rung up (never two)
    rather than open a class of its own, and keeps to its own rung when that one has rows."""
    store = KVStore(LAYOUT, 1 << 20, 16, 1000)
    low, middle, high = store.ladder[:3]  # 64, 80, 112
    assert store.reserve("wide", middle) and store.capacity_of["wide"] == middle
    assert store.reserve("short", 10) and store.capacity_of["short"] == middle  # its rung (64) is empty
    assert store.reserve("far", high) and store.capacity_of["far"] == high  # nothing above 112: its own
    assert store.reserve("own", low + 1) and store.capacity_of["own"] == middle  # 65 tokens: rung 80 itself
    store.free("short")
    store.free("own")
    store.free("wide")
    assert store.reserve("alone", 10) and store.capacity_of["alone"] == low  # 80 is empty again; 112 is two rungs up
    write(store, "alone", 10)
    assert store.reserve("next", 20) and store.capacity_of["next"] == low  # its own rung has a row now


def test_a_sequence_takes_its_own_rung_when_the_rung_above_cannot_grow_within_the_budget() -> None:
    """Joining the rung above saves a graph call, never a row: with the budget too small to grow
    that class, the sequence gets a row on its own rung instead of being refused."""
    store = KVStore(LAYOUT, KVStore.minimum_budget(LAYOUT, 80, 16), 16, 80)  # 80 + 64 tokens
    assert store.ladder == [64, 80]
    assert store.reserve("wide", 80) and store.classes[80].rows == 1
    assert store.reserve("short", 10) and store.capacity_of["short"] == 64
    assert store.physical_bytes <= store.capacity_bytes


def test_companions_at_the_same_length_move_in_one_reallocation() -> None:
    store = KVStore(LAYOUT, 1 << 20, 16, 1000)
    for i in range(15):
        assert store.reserve(f"s{i}", 51)
    for i in range(15):
        write(store, f"s{i}", 50)
    klass = store.classes[64]
    klass.lengths[:15] = 64
    for i in range(15):
        assert store.reserve(f"s{i}", 65)
    assert 64 not in store.classes and store.classes[80].rows == 15 + 15 // 8
    assert store.stats().used_bytes / store.physical_bytes >= 0.8


def test_a_class_whose_rows_would_stay_mostly_full_moves_up_as_a_whole() -> None:
    """When one member's row fills and every member would fill >= 64% of a row one rung up, the
    whole class moves there (one class, one graph call per step); with a shorter member, the full
    sequence moves alone, as before."""
    store = KVStore(LAYOUT, 1 << 20, 16, 1000)
    lengths = {"s0": 64, "s1": 60, "s2": 55, "s3": 52}  # >= 0.64 x 80 = 51.2
    for index, name in enumerate(lengths):
        assert store.reserve(name, 51)
        write(store, name, 51, float(index))
    klass = store.classes[64]
    for row, name in enumerate(klass.members):
        klass.lengths[row] = klass.positions[row, 0] = lengths[name]
        klass.mask[row, : lengths[name]] = 1
    assert store.reserve("s0", 65)
    assert 64 not in store.classes and sorted(store.classes[80].members) == sorted(lengths)
    wider = store.classes[80]
    for name, length in lengths.items():
        row = wider.members.index(name)
        assert store.capacity_of[name] == 80 and int(wider.lengths[row]) == length
        assert np.all(wider.cache[:, row, :, :51] == float(list(lengths).index(name)))
        assert np.all(wider.mask[row, :length] == 1) and np.all(wider.mask[row, length:80] == 0)
    assert store.physical_bytes == allocated(store)

    store = KVStore(LAYOUT, 1 << 20, 16, 1000)
    for name in ("full", "short"):
        assert store.reserve(name, 51)
        write(store, name, 50)
    klass = store.classes[64]
    klass.lengths[0] = klass.positions[0, 0] = 64  # "full"; "short" stays at 50 < 51.2
    assert store.reserve("full", 65)
    assert store.classes[64].members == ["short"] and store.classes[80].members == ["full"]
    assert store.physical_bytes == allocated(store)


def test_a_move_the_budget_cannot_make_room_for_takes_the_free_row_there_is() -> None:
    """A full sequence whose whole class would move up, where the wider class has one free row and
    the budget cannot grow it: the sequence takes that row, as a single mover always did, and
    nothing is re-allocated for it."""
    store = KVStore(LAYOUT, 440 * 16, 16, 80)  # 440 tokens; the ladder is [64, 80]
    for name in ("s0", "s1", "s2"):
        assert store.reserve(name, 51)
        write(store, name, 50)
    assert store.reserve("w1", 80) and store.reserve("w2", 80)
    write(store, "w1", 70)
    store.free("w2")
    wider = store.classes[80]
    assert wider.free_rows == 1
    klass = store.classes[64]
    klass.lengths[:3] = 64  # all three full: the whole class would move, three rows wanted
    assert store.reserve("s0", 65)
    assert store.classes[80] is wider and sorted(wider.members) == ["s0", "w1"]
    assert sorted(store.classes[64].members) == ["s1", "s2"]
    assert store.physical_bytes == allocated(store) <= store.capacity_bytes


def test_nothing_is_allocated_beyond_the_budget_even_while_a_class_is_reallocated() -> None:
    rng = np.random.default_rng(0)
    budget = 64 * 16 * 40
    store = KVStore(LAYOUT, budget, 16, 512)
    lengths: dict[str, int] = {}
    refused = 0
    for step in range(3000):
        name = f"s{step % 60}"
        if name in lengths and rng.random() < 0.05:
            store.free(name)
            del lengths[name]
        elif name in lengths:
            wanted = min(lengths[name] + int(rng.integers(1, 40)), 512)
            if store.reserve(name, wanted):
                klass = store.classes[store.capacity_of[name]]
                row = klass.members.index(name)
                klass.lengths[row] = klass.positions[row, 0] = wanted - 1
                lengths[name] = wanted - 1
            else:
                refused += 1
        elif store.reserve(name, (length := int(rng.integers(1, 300))) + 1):
            write(store, name, length)
            lengths[name] = length
        else:
            refused += 1
        assert store.physical_bytes == allocated(store) <= store.capacity_bytes
        assert store.peak_physical_bytes <= store.capacity_bytes
        assert sorted(store.members()) == sorted(lengths)
    assert refused > 0  # the budget was reached and held


def test_torch_arrays_hold_the_same_rows() -> None:
    store = KVStore(LAYOUT, 1 << 20, 16, 1000, TorchArrays("cpu"))
    assert store.reserve("a", 11)
    store.write("a", store.backend.upload(np.full((2, 1, 10, 2), 3.0, dtype=np.float32)), 10)
    klass = store.classes[64]
    assert type(klass.cache).__module__.startswith("torch")
    assert float(klass.cache[:, 0, :, :10].min()) == 3.0 and int(klass.mask[0].sum()) == 11


def test_scheduler_admits_in_order_within_batch_queue_and_memory_limits() -> None:
    store = KVStore(LAYOUT, KVStore.minimum_budget(LAYOUT, 256, 16), 16, 256)  # 496 tokens of rows
    scheduler = Scheduler(store, max_batch_size=2, max_queue=2)
    long, second, third = make_request("long", 250), make_request("second", 250), make_request("third", 5)
    scheduler.add(long)
    scheduler.add(second)
    with pytest.raises(QueueFullError, match="max_queue=2"):
        scheduler.add(make_request("x", 1))
    out = scheduler.schedule()
    assert out.admitted == [long] and list(scheduler.waiting) == [second]  # 256 + 256 > 496: waits
    assert store.physical_bytes == 256 * 16
    scheduler.add(third)  # would fit, but arrives after `second`
    assert scheduler.schedule().admitted == []
    long.num_computed_tokens = 250  # its prompt was written into its row
    write(store, "long", 250)
    long.output_ids.append(7)
    assert scheduler.schedule().decode == [long]  # 251 tokens still fit its row
    scheduler.remove(long)
    out = scheduler.schedule()
    assert out.admitted == [second, third] and out.decode == []
    assert store.physical_bytes == allocated(store) == (256 + 64) * 16
    scheduler.add(make_request("fourth", 1))
    assert scheduler.schedule().admitted == [] and len(scheduler.waiting) == 1  # batch limit


def test_scheduler_preempts_newest_when_memory_runs_out() -> None:
    store = KVStore(LAYOUT, 192 * 16, 16, 96)  # 192 tokens of rows
    scheduler = Scheduler(store, max_batch_size=8)
    a, b = make_request("a", 60), make_request("b", 60)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.schedule().admitted == [a, b]  # two rows of 64 (and one while growing: 192)
    for request in (a, b):
        write(store, request.request_id, 60)
        request.output_ids.extend([5] * 5)  # as if decoded: 65 tokens, this step needs a wider row
        request.num_computed_tokens = 64
    out = scheduler.schedule()  # a needs a row of 80: 128 + 80 > 192, so b gives up its row
    assert out.preempted == [b] and out.decode == [a]
    assert list(scheduler.waiting) == [b] and b.num_computed_tokens == 0 and b.attempt == 1
    assert b.prefill_ids == [1] * 60 + [5] * 4  # recomputed later without its last output token
    assert store.holders() == ["a"] and store.peak_physical_bytes <= store.capacity_bytes
    scheduler.remove(a)
    assert store.stats().used_bytes == 0 and store.physical_bytes == 0


def test_a_request_its_stop_string_ended_still_decodes_until_the_loop_reaps_it() -> None:
    """The delivering thread marks a request finished (its stop string) while the engine loop runs:
    its row is still in the store, so a decode step still feeds it (the step must feed every
    member: CI once failed every sequence of a batch with "'alibi-150' is not fed")."""
    store = KVStore(LAYOUT, KVStore.minimum_budget(LAYOUT, 256, 16), 16, 256)
    scheduler = Scheduler(store, max_batch_size=4)
    a, b = make_request("a", 10), make_request("b", 10)
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.schedule().admitted == [a, b]
    for request in (a, b):
        write(store, request.request_id, 10)
        request.num_computed_tokens = 10
        request.output_ids.append(7)
    b.finish(RequestStatus.FINISHED_STOP)  # as OutputProcessor.deliver does, on its own thread
    out = scheduler.schedule()
    assert out.decode == [a, b] and sorted(store.members()) == ["a", "b"]
    scheduler.remove(b)  # the loop reaps it at its next step
    assert scheduler.schedule().decode == [a] and store.members() == ["a"]


def test_a_class_left_mostly_spare_gives_rows_back() -> None:
    store = KVStore(LAYOUT, 1 << 20, 16, 1000)
    for i in range(8):
        assert store.reserve(f"s{i}", 20)
        write(store, f"s{i}", 19, float(i))
    for i in range(6):
        store.free(f"s{i}")
    store.trim()
    klass = store.classes[64]
    assert klass.rows == 2 and sorted(klass.members) == ["s6", "s7"]
    assert store.physical_bytes == allocated(store) == 2 * 64 * 16
    for row, name in enumerate(klass.members):
        assert np.all(klass.cache[:, row, :, :19] == float(name[1:]))
