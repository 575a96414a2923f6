"""The speculative section's pure parts: its workloads and the rank correlation it reports."""

from __future__ import annotations

import pytest

from loadtest.report.speculative_tables import spearman
from loadtest.speculative import prompts, sizes


def test_repeats_prompts_end_with_their_own_beginning_and_held_out_ones_do_not_repeat_by_construction() -> None:
    data = bytes(range(32, 127)) * 200  # printable, long enough to draw from
    for text in prompts(data, "repeats", 400, 5):
        body = text[: len(text) * 3 // 4]
        tail = text[len(body) :]
        assert body.startswith(tail) and len(tail) > 50
    plain = prompts(data, "held-out", 400, 3, seed=1)
    assert [len(p) for p in plain] == [400, 400, 400] and plain == prompts(data, "held-out", 400, 3, seed=1)


def test_sizes_fit_the_models_positions() -> None:
    assert sizes(256) == (128, 112)  # learned: prompt + new tokens + BOS within 256
    assert sizes(4096) == (480, 192)


def test_spearman_is_one_for_the_same_order_and_minus_one_reversed() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None  # too few schemes to say
    assert spearman([1, 1, 2], [3, 3, 5]) == pytest.approx(1.0)  # ties share a rank
