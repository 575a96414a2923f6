"""The benchmark's own measuring helpers: a figure it prints must mean what its label says."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from service.bench import batch_runner, decode_rate, median_of, step_seconds


def test_decode_rate_counts_tokens_between_first_and_last_chunk() -> None:
    assert decode_rate([(10.0, 1), (10.5, 3), (11.0, 101)]) == 100.0
    # A reader that got everything in one chunk measured nothing: no figure, not a crash.
    assert math.isnan(decode_rate([(10.0, 256)]))


def test_median_leaves_out_runs_without_a_figure() -> None:
    figures = iter([math.nan, 3.0, 1.0])
    assert median_of(lambda: next(figures)) == 2.0
    assert math.isnan(median_of(lambda: math.nan))


def test_step_time_is_measured_at_a_fixed_context(repository: Path) -> None:
    runner = batch_runner(repository / "alibi", 4, 40, 1)
    (klass,) = runner.store.batches()
    lengths, mask = klass.lengths.copy(), klass.mask.copy()
    assert step_seconds(runner, 10) > 0
    assert np.array_equal(klass.lengths, lengths) and np.array_equal(klass.positions[:, 0], lengths)
    assert np.array_equal(klass.mask, mask)
    assert runner.store.stats().used_tokens == 4 * 41
