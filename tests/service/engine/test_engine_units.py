"""Pure engine logic: sampling, detokenizing, the stubs (the KV store and scheduler: test_kv_store.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from service.api import build
from service.engine.messages import RequestStatus
from service.engine.processing.detokenizer import IncrementalDetokenizer
from service.engine.processing.streams import OutputStream, StreamEvent
from service.engine.request import SamplingParams
from service.engine.sampler import Sampler, probabilities


def test_sampler_filters() -> None:
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    top2 = probabilities(logits, SamplingParams(1, temperature=1.0, top_k=2))
    assert np.count_nonzero(top2) == 2 and top2[0] > top2[1] > 0
    nucleus = probabilities(logits, SamplingParams(1, temperature=1.0, top_p=0.5))
    assert np.count_nonzero(nucleus) == 1  # the top token alone holds 66%
    assert probabilities(logits, SamplingParams(1, temperature=1.0)).sum() == pytest.approx(1.0)
    sampler = Sampler()
    assert sampler.sample("r", logits, SamplingParams(1)) == 0  # greedy


def test_seeded_sampling_is_reproducible_and_follows_the_distribution() -> None:
    """Would fail for a sampler that ignored the seed or always returned the argmax: on a flat-ish
    distribution, a seed fixes the whole sequence, other seeds give other sequences, and the
    draws' frequencies follow the (filtered) softmax."""
    logits = np.array([1.0, 0.8, 0.6, 0.4, 0.2, 0.0, -0.5, -1.0])  # argmax holds ~21%
    n = 3000

    def draws(params: SamplingParams, request_id: str = "r") -> np.ndarray:
        sampler = Sampler()  # fresh: the request's generator starts from its seed
        return np.array([sampler.sample(request_id, logits, params) for _ in range(n)])

    for params in (
        SamplingParams(1, temperature=1.0, seed=5),  # plain softmax
        SamplingParams(1, temperature=0.7, top_k=5, seed=5),  # filtered: one by one
        SamplingParams(1, temperature=1.3, top_p=0.8, seed=5),
    ):
        tokens = draws(params)
        assert np.array_equal(tokens, draws(params))  # same seed, same sequence
        assert np.array_equal(tokens, draws(params, request_id="other"))  # the seed, not the id
        for seed in (6, 7, 2**64 - 1):
            other = draws(SamplingParams(1, params.temperature, params.top_k, params.top_p, seed=seed))
            assert not np.array_equal(tokens, other)
            assert np.mean(tokens != other) > 0.5  # not a shifted copy either
        expected = probabilities(logits, params)
        assert np.count_nonzero(expected) >= 4
        assert np.mean(tokens == 0) < 0.5  # not (mostly) the argmax
        assert set(tokens.tolist()) == set(np.flatnonzero(expected).tolist())  # every kept token, no other
        frequencies = np.bincount(tokens, minlength=len(logits)) / n
        # One frequency's standard error is below 0.01 here; 0.04 is a generous bound.
        assert np.abs(frequencies - expected).max() < 0.04, (frequencies, expected)


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


def test_a_sampled_token_depends_on_the_seed_and_its_index_alone() -> None:
    """A request that arrives with k tokens already produced (resumed on a restarted engine core)
    samples from token k on exactly what an uninterrupted run samples there, filtered or not."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((40, 259)).astype(np.float32) * 2
    for params in (
        SamplingParams(1, temperature=0.9, seed=7),
        SamplingParams(1, temperature=0.7, top_k=20, top_p=0.9, seed=2**64 - 1),
    ):
        uninterrupted = Sampler()
        tokens = [uninterrupted.sample("r", logits[i], params, index=i) for i in range(40)]
        for k in (1, 17, 39):
            resumed = Sampler()  # a new core: no generator kept
            assert [resumed.sample("r", logits[i], params, index=i) for i in range(k, 40)] == tokens[k:]
        # Without an index each draw is the next one: the stream np.random.default_rng(seed) gives.
        continuing = Sampler()
        assert [continuing.sample("r", logits[i], params) for i in range(40)] == tokens


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


def test_output_stream_merges_what_the_consumer_has_not_taken_and_stays_readable_once_closed() -> None:
    stream = OutputStream()
    assert stream.get(timeout=0.01) is None  # nothing yet: a timeout, not an event
    stream.put("a")
    stream.put("b")
    assert stream.get(timeout=1) == StreamEvent("ab", RequestStatus.RUNNING)  # one wake-up, both texts
    assert stream.get(timeout=0.01) is None  # nothing left over, no stale wake-up
    woken: list[StreamEvent | None] = []
    reader = threading.Thread(target=lambda: woken.append(stream.get(timeout=5)))
    reader.start()
    stream.put("c")
    reader.join()
    assert woken == [StreamEvent("c", RequestStatus.RUNNING)]  # a waiting consumer is woken
    stream.put("d")
    stream.close("e", RequestStatus.FINISHED_LENGTH)
    assert stream.get(timeout=1) == StreamEvent("de", RequestStatus.FINISHED_LENGTH)
    for _ in range(2):  # closed: every later call answers at once, with no text
        assert stream.get(timeout=None) == StreamEvent("", RequestStatus.FINISHED_LENGTH)


def test_eos_is_masked_while_a_request_may_not_end() -> None:
    """ignore_eos masks EOS always, min_tokens until that many tokens exist; other rows keep theirs."""
    from service.engine.request import Request

    eos = 257
    logits = np.zeros((3, 259), dtype=np.float32)
    logits[:, eos] = 10.0  # EOS is every row's argmax
    logits[:, 65] = 5.0

    def request(params: SamplingParams, produced: int) -> Request:
        made = Request("r", "m", [256], params, eos)
        made.output_ids = [66] * produced
        return made

    rows = [
        request(SamplingParams(8, ignore_eos=True), 7),
        request(SamplingParams(8, min_tokens=4), 3),
        request(SamplingParams(8, min_tokens=4), 4),
    ]
    assert Sampler().sample_batch(rows, logits, greedy=True) == [65, 65, eos]
    assert logits[0, eos] == 10.0  # the caller's logits are untouched
    sampled = [request(SamplingParams(8, temperature=1.0, seed=s, ignore_eos=True), 0) for s in range(50)]
    assert eos not in Sampler().sample_batch(sampled, np.repeat(logits[:1], 50, axis=0))
    assert SamplingParams(8, min_tokens=4).eos_allowed(4) and not SamplingParams(8, min_tokens=4).eos_allowed(3)
    assert not SamplingParams(8, ignore_eos=True).eos_allowed(100)
    other = np.random.default_rng(0).standard_normal((4, 259)).astype(np.float32)
    other[:, eos] = -5.0  # masking a logit that was never the argmax changes nothing
    never = [request(SamplingParams(8, ignore_eos=True), 0) for _ in range(4)]
    assert Sampler().sample_batch(never, other, greedy=True) == other.argmax(axis=1).tolist()
