"""The benchmark's step-time fixtures: a figure it prints must mean what its label says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.runners import batch_runner, bounded_step_seconds, policy_runner, step_seconds
from contract.cache_policy import FULL_POLICY, parse_cache_policy
from contract.manifest import Manifest
from service.engine.kv import INT8, INT8_CHANNEL


def test_step_time_is_measured_at_a_fixed_context(repository: Path) -> None:
    runner = batch_runner(repository / "alibi", 4, 40, 1)
    (klass,) = runner.store.batches()
    lengths, mask = klass.lengths.copy(), klass.mask.copy()
    assert step_seconds(runner, 10) > 0
    assert np.array_equal(klass.lengths, lengths) and np.array_equal(klass.positions[:, 0], lengths)
    assert np.array_equal(klass.mask, mask)
    assert runner.store.stats().used_tokens == 4 * 41


def test_a_bounded_policy_steps_at_a_fixed_cache_size(repository: Path) -> None:
    """Rows that have seen 300 tokens under sinks:4+window:60 hold 64; each measured step evicts one
    and appends one, so the history grows and the cache (and its memory) does not."""
    runner = policy_runner(repository / "alibi", 2, 300, parse_cache_policy("sinks:4+window:60"), 1)
    (klass,) = runner.store.batches()
    before = runner.store.stats().physical_bytes
    assert list(klass.lengths[:2]) == [64, 64] and klass.policies[0].evicted == 300 - 64
    assert bounded_step_seconds(runner, 5) > 0
    assert list(klass.lengths[:2]) == [64, 64] and klass.policies[0].evicted == 300 - 64 + 6  # warm-up + 5
    assert list(klass.positions[:2, 0]) == [64, 64]  # alibi: positions within the cache
    assert runner.store.stats().physical_bytes == before


def test_an_int8_policy_row_is_held_in_int8(repository: Path) -> None:
    """The bench's int8 figures are measured on int8 rows: the unbounded policy's in the channel format
    (25% of float32's bytes for the same row), a bounded one's with per-token scales (28%)."""
    full = policy_runner(repository / "alibi", 1, 300, parse_cache_policy("full"), 1)
    int8 = policy_runner(repository / "alibi", 1, 300, parse_cache_policy("int8"), 1)
    (klass,) = int8.store.batches()
    assert klass.kind == INT8_CHANNEL
    assert int8.store.stats().physical_bytes / full.store.stats().physical_bytes == 1 / 4
    window, window_int8 = (
        policy_runner(repository / "alibi", 1, 300, parse_cache_policy(p), 1) for p in ("window:64", "window:64+int8")
    )
    (klass,) = window_int8.store.batches()
    assert klass.kind == INT8
    assert window_int8.store.stats().physical_bytes / window.store.stats().physical_bytes == (32 + 4) / (4 * 32)


def test_a_hybrid_s_split_rows_hold_the_window_before_the_next_token(repository: Path) -> None:
    """The bench times a hybrid's split rows as the service holds them: the global K/V of the whole
    context, the local layers' of the window before the next token, and a step reads the same both times."""
    if Manifest.load(repository / "rope-swa").local_cache is None:
        pytest.skip("an export from before per-group caches")
    runner = policy_runner(repository / "rope-swa", 2, 1000, FULL_POLICY, 1)
    klass = next(runner.store.batches())
    assert runner.layout.split and klass.local is not None
    assert list(klass.local.lengths[:2]) == [63, 63] and list(klass.lengths[:2]) == [1000, 1000]
    step_seconds(runner, 3)
    assert list(klass.local.lengths[:2]) == [63, 63] and list(klass.lengths[:2]) == [1000, 1000]
