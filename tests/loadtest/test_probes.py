"""The graded retrieval probes against models whose answers are known: a copy-perfect induction
model (predicts the byte that followed the latest earlier occurrence of the 8 bytes before)
and a model that cannot copy (always predicts a space). The scoring path is the one the
comparison uses (ScoreResponse.greedy_tokens); the models stand in for the service's graph."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from loadtest.probes import (
    Scorer,
    copy_text,
    depth_text,
    passkey_text,
    ratio_interval,
    repeated_ngram_distances,
    wilson,
)
from service.api import generation_pb2 as pb

Predictor = Callable[[bytes, int], int]  # (text bytes, offset) -> predicted byte at offset


def induction(data: bytes, offset: int, k: int = 8) -> int:
    """The byte after the latest earlier occurrence of the k bytes before `offset` (else a space)."""
    if offset < k:
        return 32
    key = data[offset - k : offset]
    found = data.rfind(key, 0, offset - 1)
    return data[found + k] if found >= 0 else 32


def no_copy(data: bytes, offset: int) -> int:
    return 32


class PredictorStub:
    """Answers Score the way the servicer does: per byte, a log-probability and a greedy token."""

    def __init__(self, predict: Predictor) -> None:
        self.predict = predict

    def Score(self, request: pb.ScoreRequest, timeout: float | None = None) -> pb.ScoreResponse:
        data = request.text.encode()
        greedy = [self.predict(data, i) for i in range(len(data))]
        logprobs = [0.0 if g == b else math.log(1 / 256) for g, b in zip(greedy, data, strict=True)]
        return pb.ScoreResponse(token_logprobs=logprobs, tokens=len(data), greedy_tokens=greedy)


def filler(seed: int = 0) -> Callable[[int], str]:
    """Code-like text without long repeats."""
    rng = random.Random(seed)
    words = ["value", "result", "items", "index", "count", "name", "data", "self", "return", "for", "in"]

    def text(length: int) -> str:
        out = ""
        while len(out) < length:
            out += f"{rng.choice(words)}_{rng.randrange(10**6)} = {rng.choice(words)}({rng.randrange(99)})\n"
        return out[:length]

    return text


def test_wilson_interval_matches_the_textbook_values() -> None:
    interval = wilson(0.5, 100)
    assert interval.low == pytest.approx(0.4038, abs=1e-3) and interval.high == pytest.approx(0.5962, abs=1e-3)
    assert wilson(0.0, 10).low == 0.0 and wilson(0.0, 10).high == pytest.approx(0.2775, abs=1e-3)
    assert wilson(1.0, 10).high == pytest.approx(1.0) and wilson(1.0, 10).low == pytest.approx(0.7225, abs=1e-3)


def test_ratio_interval_is_the_pooled_mean_and_narrows_with_more_windows() -> None:
    few = ratio_interval([(10.0, 10), (30.0, 10)])
    many = ratio_interval([(10.0, 10), (30.0, 10)] * 20)
    assert few is not None and many is not None
    assert few.value == pytest.approx(2.0) and many.value == pytest.approx(2.0)
    assert many.high - many.low < few.high - few.low


def test_repeated_ngram_distances_finds_the_previous_occurrence() -> None:
    data = b"abcdefgh" + b"XYZ" + b"abcdefgh"
    assert repeated_ngram_distances(data) == {len(data) - 1: 11}


@pytest.mark.parametrize("probe", ["copy", "depth", "passkey"])
def test_probe_texts_score_exactly_the_planted_answer(probe: str) -> None:
    rng, text = random.Random(1), filler()
    made = {
        "copy": lambda: copy_text(text, rng, 64, 300),
        "depth": lambda: depth_text(text, rng, 512, 0.1),
        "passkey": lambda: passkey_text(text, rng, 512),
    }[probe]()
    data = made.text.encode()
    answer = data[made.scored[0] : made.scored[-1] + 1]
    assert made.scored[-1] == len(data) - 1
    assert data.count(answer) == 2  # planted once, asked for once
    if probe != "passkey":
        assert len(data) <= 512 + 64 + 300 + 40


def test_a_copy_perfect_model_scores_one_and_a_model_that_cannot_copy_scores_zero() -> None:
    rng, text = random.Random(2), filler()
    copies = [copy_text(text, rng, 64, 1000) for _ in range(12)]
    keys = [passkey_text(text, rng, 1024) for _ in range(12)]
    perfect = Scorer(PredictorStub(induction), "stub", limit=0)  # type: ignore[arg-type]
    blind = Scorer(PredictorStub(no_copy), "stub", limit=0)  # type: ignore[arg-type]
    assert perfect.accuracy(copies)["value"] == 1.0 and perfect.accuracy(keys)["value"] == 1.0  # type: ignore[index]
    assert blind.accuracy(copies)["value"] == 0.0 and blind.accuracy(keys)["value"] == 0.0  # type: ignore[index]
    low = blind.accuracy(copies)
    assert low is not None and low["high"] < 0.3 and low["n"] == 12
    bounded = Scorer(PredictorStub(induction), "stub", limit=256)  # type: ignore[arg-type]
    assert bounded.accuracy(copies) is None  # longer than the model's positions: not servable


def test_natural_long_range_bits_are_lower_where_an_ngram_repeats_for_a_model_that_copies() -> None:
    text = filler(3)
    windows = []
    for _ in range(6):
        block = text(200)
        windows.append(block + text(300) + block + text(100))  # the block repeats 500 bytes later
    natural = Scorer(PredictorStub(induction), "stub", limit=0).natural(windows, 1024)  # type: ignore[arg-type]
    assert set(natural) == {"32", "64", "128", "256", "512", "1024", "all"}
    repeated, everything = natural["512"], natural["all"]
    assert repeated is not None and everything is not None
    assert repeated["value"] < 0.5 * everything["value"]
    bounded = Scorer(PredictorStub(induction), "stub", limit=256).natural(windows, 1024)  # type: ignore[arg-type]
    assert bounded["512"] is None and bounded["1024"] is None and bounded["all"] is not None
