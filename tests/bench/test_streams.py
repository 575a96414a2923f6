"""The benchmark's stream measurements: a figure it prints must mean what its label says."""

from __future__ import annotations

import math

from bench.streams import decode_rate, median_of


def test_decode_rate_counts_tokens_between_first_and_last_chunk() -> None:
    assert decode_rate([(10.0, 1), (10.5, 3), (11.0, 101)]) == 100.0
    # A reader that got everything in one chunk measured nothing: no figure, not a crash.
    assert math.isnan(decode_rate([(10.0, 256)]))


def test_median_leaves_out_runs_without_a_figure() -> None:
    figures = iter([math.nan, 3.0, 1.0])
    assert median_of(lambda: next(figures)) == 2.0
    assert math.isnan(median_of(lambda: math.nan))
