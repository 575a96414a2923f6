"""The prefix cache in the KV store: hash chains, exact hits, least-recently-used eviction, and blocks
that live inside the budget (no ONNX Runtime here)."""

from __future__ import annotations

import numpy as np

from service.engine.kv import KVLayout, KVStore, TorchArrays
from service.engine.kv.prefix import block_hashes

LAYOUT = KVLayout(n_layers=1, n_heads=1, head_dim=2, dtype="float32")  # 16 bytes per token
BLOCK = 16
EXTRA = ("m", "full")


def prompt_kv(length: int, seed: int = 0) -> np.ndarray:
    """A prompt's K/V as the prefill returns it: (2 x layers, heads, length, head_dim)."""
    return np.random.default_rng(seed).standard_normal((2, 1, length, 2)).astype(np.float32)


def cache(store: KVStore, tokens: list[int], kv: np.ndarray, extra: tuple[str, str] = EXTRA) -> int:
    return store.cache_prompt(tokens, block_hashes(tokens, BLOCK, extra), extra, kv, extra[1])


def test_a_chain_names_a_block_and_everything_before_it() -> None:
    a = block_hashes(list(range(40)), BLOCK, EXTRA)
    b = block_hashes([*range(32), 99, 98], BLOCK, EXTRA)
    assert len(a) == 2 and len(b) == 2  # full blocks only
    assert a == b  # the first 32 tokens agree; the partial third block is not keyed
    c = block_hashes([7, *range(1, 40)], BLOCK, EXTRA)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every key after it
    assert block_hashes(list(range(40)), BLOCK, ("m", "int8")) != a  # the policy's form is part of the key


def test_a_hit_gives_the_cached_kv_of_the_leading_blocks_exactly() -> None:
    store = KVStore(LAYOUT, 1 << 20, BLOCK, 1024)
    tokens = list(range(50))
    kv = prompt_kv(50)
    assert cache(store, tokens, kv) == 3  # 3 full blocks of 16; the last 2 tokens are not kept
    assert store.stats().cached_bytes == store.physical_bytes == 3 * BLOCK * LAYOUT.token_bytes
    assert store.stats().used_bytes == store.physical_bytes  # cached blocks count as used
    other = [*range(40), 1, 2, 3, 4, 5]  # shares two whole blocks and 8 tokens of the third
    hashes = block_hashes(other, BLOCK, EXTRA)
    tokens_hit, past = store.cached_prefix(other, hashes, EXTRA, len(other) - 1)
    assert tokens_hit == 32 and past.shape == (2, 1, 1, 32, 2)
    np.testing.assert_array_equal(past[:, 0], kv[:, :, :32])
    assert past.flags.c_contiguous
    # The whole prompt again: every cached block but never the last token (its logits are needed).
    tokens_hit, past = store.cached_prefix(tokens[:48], block_hashes(tokens[:48], BLOCK, EXTRA), EXTRA, 47)
    assert tokens_hit == 47
    np.testing.assert_array_equal(past[:, 0], kv[:, :, :47])
    assert store.cached_prefix(tokens, block_hashes(tokens, BLOCK, ("m", "int8")), ("m", "int8"), 49) == (0, None)


def test_cached_blocks_never_push_physical_bytes_over_the_budget() -> None:
    budget = KVStore.minimum_budget(LAYOUT, 256, BLOCK) + 8 * BLOCK * LAYOUT.token_bytes
    store = KVStore(LAYOUT, budget, BLOCK, 256)
    for seed in range(40):  # far more prompts than the budget holds
        tokens = [seed * 1000 + i for i in range(64)]
        cache(store, tokens, prompt_kv(64, seed))
        assert store.physical_bytes <= store.capacity_bytes
        assert store.peak_physical_bytes <= store.capacity_bytes
    assert store.prefix.evictions > 0 and store.prefix.nbytes > 0
    # Rows take the memory back: the longest sequence fits, cached blocks evicted for it.
    assert store.reserve("long", 256)
    assert store.physical_bytes <= store.capacity_bytes
    store.write("long", prompt_kv(200), 200)
    assert store.reserve("long-2", 200)
    assert store.physical_bytes <= store.capacity_bytes and store.peak_physical_bytes <= store.capacity_bytes


def test_rows_evict_cached_blocks_before_they_are_refused() -> None:
    budget = KVStore.minimum_budget(LAYOUT, 256, BLOCK)
    store = KVStore(LAYOUT, budget, BLOCK, 256)
    tokens = list(range(256))
    added = cache(store, tokens, prompt_kv(256))
    assert added > 0 and store.physical_bytes == added * BLOCK * LAYOUT.token_bytes
    assert store.reserve("a", 256)  # the minimum budget holds one longest sequence: the blocks must go
    assert store.physical_bytes <= store.capacity_bytes
    assert store.prefix.nbytes < added * BLOCK * LAYOUT.token_bytes


def test_eviction_is_least_recently_used_leaf_first() -> None:
    store = KVStore(LAYOUT, 1 << 20, BLOCK, 1024)
    old, new = list(range(32)), list(range(100, 132))
    cache(store, old, prompt_kv(32))
    cache(store, new, prompt_kv(32, 1))
    store.cached_prefix(old, block_hashes(old, BLOCK, EXTRA), EXTRA, 31)  # `old` is used again
    old_keys, new_keys = block_hashes(old, BLOCK, EXTRA), block_hashes(new, BLOCK, EXTRA)
    # Eviction order: `new`'s leaf, its root, then `old`'s leaf and root (a root never goes before its leaves).
    assert list(store.prefix.blocks) == [new_keys[1], new_keys[0], old_keys[1], old_keys[0]]
    assert store.prefix.evict_oldest() > 0
    assert list(store.prefix.blocks) == [new_keys[0], old_keys[1], old_keys[0]]
    assert store.cached_prefix(new, new_keys, EXTRA, 31)[0] == 16  # the root alone still hits


def test_the_torch_store_path_caches_and_hits_alike() -> None:
    """The GPU path's arrays (torch tensors, here on the CPU): blocks are contiguous copies, a hit one tensor."""
    import torch

    store = KVStore(LAYOUT, 1 << 20, BLOCK, 1024, TorchArrays("cpu"))
    tokens = list(range(40))
    kv = torch.from_numpy(prompt_kv(40))
    assert cache(store, tokens, kv) == 2
    hit, past = store.cached_prefix(tokens, block_hashes(tokens, BLOCK, EXTRA), EXTRA, 20)
    assert hit == 20 and past.is_contiguous() and tuple(past.shape) == (2, 1, 1, 20, 2)
    assert torch.equal(past[:, 0], kv[:, :, :20])


def test_a_row_that_could_not_fit_even_after_evicting_leaves_the_cache_alone() -> None:
    """A class that cannot grow beside its old array within the budget (torch arrays, as on a GPU,
    grow by copy): evicting every cached block would not make room, so none is evicted (the cache
    once lost its shared prefix to each such try, and every later request recomputed it)."""
    budget = 6 * 64 * LAYOUT.token_bytes  # six rows of 64 tokens
    import torch

    store = KVStore(LAYOUT, budget, BLOCK, 64, backend=TorchArrays("cpu"))
    shared = list(range(48))
    assert cache(store, shared, torch.from_numpy(prompt_kv(48))) == 3
    cached = store.prefix.nbytes
    admitted = 0
    while store.reserve(f"r{admitted}", 64):
        admitted += 1
    klass = store.classes[64]
    held = klass.rows - klass.free_rows
    # The refusal was not for want of the cache's bytes: old array + grown one exceed the budget alone.
    assert store.physical_bytes - cached + (held + 1) * 64 * LAYOUT.token_bytes > store.capacity_bytes
    assert admitted >= 2 and store.prefix.nbytes == cached and store.prefix.evictions == 0
    assert store.cached_prefix(shared, block_hashes(shared, BLOCK, EXTRA), EXTRA, 47)[0] == 47


def test_host_rows_grow_in_place_to_the_whole_budget_evicting_cached_blocks_last() -> None:
    """Host arrays change their row count in place: the same budget holds all six rows, the cached
    blocks evicted as the last rows need their bytes (and only then)."""
    store = KVStore(LAYOUT, 6 * 64 * LAYOUT.token_bytes, BLOCK, 64)
    shared = list(range(48))
    cache(store, shared, prompt_kv(48))
    admitted = 0
    while store.reserve(f"r{admitted}", 64):
        admitted += 1
        assert store.peak_physical_bytes <= store.capacity_bytes
        assert store.prefix.evictions == 0 or store.physical_bytes > 3 * 64 * LAYOUT.token_bytes
    assert admitted == 6 and store.classes[64].rows == 6 and store.prefix.nbytes == 0


def test_a_reservation_evicts_no_block_it_is_told_to_keep() -> None:
    store = KVStore(LAYOUT, KVStore.minimum_budget(LAYOUT, 256, BLOCK), BLOCK, 256)
    tokens = list(range(256))
    added = cache(store, tokens, prompt_kv(256))
    keys = frozenset(block_hashes(tokens, BLOCK, EXTRA))
    assert not store.reserve("a", 256, keep=keys)  # only the kept blocks could make room
    assert store.prefix.nbytes == added * BLOCK * LAYOUT.token_bytes and store.holders() == []
    assert store.reserve("a", 256)  # without `keep` they go, as before
    assert store.prefix.nbytes < added * BLOCK * LAYOUT.token_bytes


def test_a_later_admission_of_the_same_step_never_evicts_the_blocks_an_earlier_one_takes() -> None:
    """The scheduler admits `a` (its prompt's 48 leading tokens cached) and then `b`, whose row
    only fits by evicting cached blocks: `b` waits for a row rather than take the blocks `a` is
    about to read (the engine takes them after the step's admissions); once nothing runs, `b` may
    evict to be admitted."""
    from service.engine.request import Request, SamplingParams
    from service.engine.sched.scheduler import Scheduler

    store = KVStore(LAYOUT, (64 + 48 + 16) * LAYOUT.token_bytes, BLOCK, 64)
    assert cache(store, [1] * 48, prompt_kv(48)) == 3
    scheduler = Scheduler(store, max_batch_size=4)
    scheduler.prefix_blocks = lambda request: frozenset(block_hashes(request.prompt_ids, BLOCK, EXTRA))
    a = Request("a", "m", [1] * 60, SamplingParams(max_new_tokens=2), eos_token_id=257)  # a row of 64
    b = Request("b", "m", [1] * 20, SamplingParams(max_new_tokens=2), eos_token_id=257)  # a row of 32
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.schedule().admitted == [a]
    assert list(scheduler.waiting) == [b] and store.prefix.evictions == 0
    assert store.cached_prefix(a.prompt_ids, block_hashes(a.prompt_ids, BLOCK, EXTRA), EXTRA, 59)[0] == 48
    scheduler.remove(a)
    assert scheduler.schedule().admitted == [b]  # nothing runs: it may evict (its own leading block stays)
    assert store.physical_bytes <= store.capacity_bytes
