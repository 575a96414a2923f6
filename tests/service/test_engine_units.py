"""Pure engine logic: block accounting, scheduling, sampling, detokenizing, the stubs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.api import build
from service.engine.detokenizer import IncrementalDetokenizer
from service.engine.kv_cache import KVCacheManager
from service.engine.request import Request, SamplingParams
from service.engine.sampler import Sampler, probabilities
from service.engine.scheduler import QueueFullError, Scheduler


def make_request(request_id: str, prompt_len: int, max_new: int = 10) -> Request:
    return Request(request_id, "m", [1] * prompt_len, SamplingParams(max_new_tokens=max_new), eos_token_id=257)


def test_kv_blocks_grow_one_at_a_time_and_free_exactly() -> None:
    kv = KVCacheManager(budget_bytes=10 * 16 * 100, bytes_per_token=100, block_size=16)
    assert kv.total_blocks == 10
    assert kv.allocate("a", 17) and kv.stats().used_blocks == 2
    assert kv.allocate("a", 32) and kv.stats().used_blocks == 2
    assert kv.allocate("a", 33) and kv.stats().used_blocks == 3
    assert kv.allocate("b", 16 * 7) and kv.stats().used_blocks == 10
    assert not kv.allocate("c", 1) and "c" not in kv.holders()
    assert not kv.allocate("a", 16 * 4)  # no partial growth either
    assert len(kv.block_table("a")) == 3
    assert len(set(kv.block_table("a")) | set(kv.block_table("b"))) == 10
    kv.free("a")
    kv.free("b")
    stats = kv.stats()
    assert stats.used_bytes == 0 and stats.capacity_bytes == 10 * 16 * 100


def test_reserved_but_unused_is_under_one_block_per_sequence() -> None:
    kv = KVCacheManager(budget_bytes=1 << 30, bytes_per_token=4096, block_size=16)
    lengths = np.random.default_rng(0).integers(200, 2048, size=32)
    for i, length in enumerate(lengths):
        assert kv.allocate(str(i), int(length))
    stats = kv.stats()
    wasted = stats.used_blocks * 16 - int(lengths.sum())
    assert wasted < 16 * 32
    assert wasted / lengths.sum() < 0.05


def test_scheduler_admits_in_order_within_batch_queue_and_block_limits() -> None:
    kv = KVCacheManager(budget_bytes=17 * 16, bytes_per_token=1, block_size=16)
    scheduler = Scheduler(kv, max_batch_size=2, max_queue=2)
    long, short, third = make_request("long", 250), make_request("short", 20), make_request("third", 5)
    scheduler.add(long)
    scheduler.add(short)
    with pytest.raises(QueueFullError, match="max_queue=2"):
        scheduler.add(make_request("x", 1))
    out = scheduler.schedule()
    assert out.admitted == [long] and list(scheduler.waiting) == [short]  # 16 blocks + 2 > 17: waits
    assert kv.stats().used_blocks == 16  # the whole prompt's blocks, taken at admission
    scheduler.add(third)
    long.num_computed_tokens = 250  # its prefill joined the batch
    long.output_ids.append(7)
    assert scheduler.schedule().decode == [long]  # 251 tokens still fit in 16 blocks
    scheduler.remove(long)
    out = scheduler.schedule()
    assert out.admitted == [short, third] and out.decode == []
    assert kv.stats().used_blocks == 3
    scheduler.add(make_request("fourth", 1))
    assert scheduler.schedule().admitted == [] and len(scheduler.waiting) == 1  # batch limit


def test_scheduler_preempts_newest_when_the_pool_runs_dry() -> None:
    kv = KVCacheManager(budget_bytes=4 * 16, bytes_per_token=1, block_size=16)
    scheduler = Scheduler(kv, max_batch_size=8)
    a, b = make_request("a", 32), make_request("b", 32)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    for request in (a, b):
        request.num_computed_tokens = 32
        request.output_ids.append(5)
    out = scheduler.schedule()  # a needs a 3rd block: b is preempted
    assert out.preempted == [b] and out.decode == [a]
    assert list(scheduler.waiting) == [b] and b.num_computed_tokens == 0 and b.attempt == 1
    assert b.prefill_ids == [1] * 32  # recomputed later without its last output token
    scheduler.remove(a)
    assert kv.stats().used_blocks == 0


def test_sampler_filters() -> None:
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    top2 = probabilities(logits, SamplingParams(1, temperature=1.0, top_k=2))
    assert np.count_nonzero(top2) == 2 and top2[0] > top2[1] > 0
    nucleus = probabilities(logits, SamplingParams(1, temperature=1.0, top_p=0.5))
    assert np.count_nonzero(nucleus) == 1  # the top token alone holds 66%
    assert probabilities(logits, SamplingParams(1, temperature=1.0)).sum() == pytest.approx(1.0)
    sampler = Sampler()
    assert sampler.sample("r", logits, SamplingParams(1)) == 0  # greedy
    draws = [Sampler().sample("r", logits, SamplingParams(1, temperature=1.0, seed=5)) for _ in range(3)]
    assert len(set(draws)) == 1  # the seed fixes the draw


def test_batched_sampling_equals_each_request_alone() -> None:
    """A row's token depends on its own logits, parameters and generator, not on its batch."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((12, 259)).astype(np.float32) * 3
    params = [
        SamplingParams(
            1, temperature=[0.0, 0.7, 1.3][i % 3], top_k=[0, 0, 5, 0][i % 4], top_p=[1.0, 0.9][i % 2], seed=i
        )
        for i in range(12)
    ]
    ids = [f"r{i}" for i in range(12)]
    batched, alone = Sampler(), Sampler()
    for _ in range(20):
        order = rng.permutation(12)
        together = batched.sample_rows([ids[i] for i in order], [params[i] for i in order], logits[order])
        for token, i in zip(together, order, strict=True):
            assert token == alone.sample(ids[i], logits[i], params[i])


def test_detokenizer_never_splits_characters_and_hides_stop_prefixes() -> None:
    detok = IncrementalDetokenizer()
    encoded = "é→".encode()
    pieces = [detok.push(b) for b in encoded]
    assert pieces == ["", "é", "", "", "→"]
    detok = IncrementalDetokenizer(stop=("END",))
    out = "".join(detok.push(b) for b in b"abcEN")
    assert out == "abc"  # "EN" is held back: it may become END
    assert detok.push(ord("D")) == "" and detok.stopped
    detok = IncrementalDetokenizer(stop=("END",))
    assert "".join(detok.push(b) for b in b"xEN") + detok.flush() == "xEN"


def test_detokenizer_streams_any_bytes_as_one_decode_would() -> None:
    """Pieces, joined, equal decoding all bytes at once (invalid ones as U+FFFD): the ASCII
    fast path must not skip past a character whose first bytes the decoder holds."""
    rng = np.random.default_rng(0)
    alphabet = [*"aé→€😀\n".encode(), 0x80, 0xC3, 0xE2, 0xFF]
    for _ in range(200):
        data = bytes(rng.choice(alphabet, size=int(rng.integers(1, 40))).tolist())
        detok = IncrementalDetokenizer()
        pieces = [detok.push(b) for b in data]
        assert "".join(pieces) + detok.flush() == data.decode("utf-8", errors="replace")


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    build.generate(tmp_path)
    for name in build.GENERATED:
        assert (tmp_path / name).read_text() == (build.OUT / name).read_text(), (
            f"{name} drifted: run python -m service.api.build"
        )
