"""Figures over rounds (loadtest/study/rounds.py): medians, ranges, the goodput ratio on the medians,
"within noise" where ranges overlap, and how the report shows them (pure logic: no server)."""

from __future__ import annotations

import pytest

from loadtest.report.findings import load_verdict
from loadtest.report.reuse_tables import shared_prefix_table
from loadtest.report.tables import goodput_section, grid_table
from loadtest.study.results import Results
from loadtest.study.rounds import Spread, compared, goodput_ratio_rounds, median_figures


def level(goodput: float, kv: float = 1.0) -> dict[str, float]:
    return {"goodput_per_s": goodput, "refused_per_s": 1.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "p99_s": 0.4,
            "tokens_per_s": 50.0, "kv_peak_bytes": kv}  # fmt: skip


def test_a_spread_is_the_median_and_the_range_and_says_when_two_overlap() -> None:
    spread = Spread.of([3.0, 1.0, 2.0])
    assert (spread.median, spread.low, spread.high, spread.rounds) == (2.0, 1.0, 3.0, 3)
    assert spread.text() == "2.00 [1.00-3.00]"
    assert Spread.of([0.0012]).text(2, 1000) == "1.20"  # one round: no range to show
    assert spread.overlaps(Spread.of([2.9, 4.0, 5.0]))
    assert not spread.overlaps(Spread.of([3.1, 4.0, 5.0]))
    with pytest.raises(ValueError):
        Spread.of([])


def test_a_levels_figures_are_each_figures_median_and_the_kv_peak_the_most_held() -> None:
    merged = median_figures([level(10, kv=5), level(30, kv=2), level(20, kv=9)])
    assert merged["goodput_per_s"] == 20 and merged["kv_peak_bytes"] == 9


def test_the_goodput_ratio_is_of_the_medians_with_each_rounds_own_ratio_beside_it() -> None:
    by_users = {
        "1": [level(10), level(10), level(10)],
        "8": [level(20), level(40), level(30)],
        "32": [level(30), level(20), level(24)],
    }
    ratio, spread = goodput_ratio_rounds(by_users)
    assert ratio == pytest.approx(24 / 30)  # median at 32 over the best median at fewer users
    assert spread is not None and spread.rounds == 3
    assert (spread.low, spread.high) == pytest.approx((0.5, 1.5))  # 20/40 and 30/20
    assert goodput_ratio_rounds({"1": [level(1)]}) == (None, None)


def test_schemes_whose_ranges_overlap_are_within_noise_of_the_best() -> None:
    spreads = {"a": Spread.of([10, 11, 12]), "b": Spread.of([9, 10, 11.5]), "c": Spread.of([5, 6, 7])}
    assert compared(spreads, higher_is_better=True) == {"a": "best", "b": "within noise of a", "c": "below a"}
    assert compared(spreads, higher_is_better=False)["c"] == "best"
    assert compared(spreads, higher_is_better=False)["a"] == "above c"


def rounds_results() -> Results:
    def series(top: list[float]) -> dict[str, list[dict[str, float]]]:
        return {"1": [level(10)] * 3, "32": [level(g) for g in top]}

    rounds = {"fast": series([9, 9.5, 10]), "slow": series([6, 7, 7.5])}
    return Results.from_dict({
        "run_id": "t", "environment": {}, "schemes": ["fast", "slow"], "config": {"admission_ttft_slo_s": 0.4},
        "load": {s: {u: median_figures(r) for u, r in by.items()} for s, by in rounds.items()},
        "load_admission": {s: {u: median_figures(r) for u, r in by.items()} for s, by in rounds.items()},
        "load_rounds": {"load": rounds, "load_admission": rounds},
        "itl": {"fast": {"2048": 0.0020}, "slow": {"2048": 0.0021}},
        "latency_rounds": {"itl": {"fast": {"2048": [0.0019, 0.0020, 0.0022]}, "slow": {"2048": [0.0021] * 3}}},
    })  # fmt: skip


def test_the_findings_give_the_rounds_range_the_shortfall_and_within_noise() -> None:
    results = rounds_results()
    fast, slow = load_verdict(results, "fast"), load_verdict(results, "slow")
    assert fast.startswith("9.50 [9.00-10.00] good req/s at 32 users with admission (best), 0.95 of its best")
    assert "(rounds 0.90-1.00)" in fast and "short of" not in fast
    assert "(below fast)" in slow and "0.70 of its best at fewer users (rounds 0.60-0.75)" in slow
    assert "short of the 0.8 goal by 0.10" in slow
    assert "ITL 2.10 [2.10-2.10] ms at 2048 bytes (within noise of fast)" in slow
    assert slow.endswith("medians of 3 rounds [min-max]")


def test_the_tables_show_the_rounds_range() -> None:
    results = rounds_results()
    section = goodput_section(results)
    assert "| slow | 32 | 7.00 [6.00-7.50] | 7.00 [6.00-7.50] |" in section
    assert "| slow | 0.70 | 0.70 | 0.60-0.75 |" in section
    assert "slow by 0.10 (rounds 0.60-0.75)" in section
    table = grid_table("ITL", results.itl, 1000.0, 2, results.latency_rounds["itl"])
    assert "| fast | 2.00 [1.90-2.20] |" in table


def test_the_shared_prefix_table_shows_the_rounds_range_and_reads_older_runs() -> None:
    rounds = {"no_cache": {"1": [level(2), level(3), level(4)]}, "cache": {"1": [level(5), level(6), level(9)]}}
    shared = {"prefix_bytes": 200, "tail_bytes": 20, "new_tokens": 8, "rounds": rounds,
              "no_cache": {"1": median_figures(rounds["no_cache"]["1"])},
              "cache": {"1": median_figures(rounds["cache"]["1"])}}  # fmt: skip
    results = Results.from_dict({
        "run_id": "t", "environment": {}, "schemes": ["a"], "config": {},
        "reuse": {"a": {"segment_reuse": "as_is", "shared_prefix": shared, "documents": {}}},
    })  # fmt: skip
    assert "| 3.00 [2.00-4.00] | 6.00 [5.00-9.00] |" in shared_prefix_table(results)
    del shared["rounds"]  # a run measured before rounds: the one figure
    assert "| 3.00 | 6.00 |" in shared_prefix_table(results)


def test_goodput_ranks_only_schemes_served_the_same_prompts() -> None:
    """A scheme with a position limit gets shorter load prompts (learned: 200 bytes, not 512): its
    goodput is not ranked against the others', however high, and theirs not against it."""
    results = rounds_results()
    results.models = {"fast": {"max_positions": 256}, "slow": {"max_positions": None}}  # type: ignore[typeddict-item]
    fast, slow = load_verdict(results, "fast"), load_verdict(results, "slow")
    assert "(not ranked: served 200-byte prompts (its 256 positions), the others 512)" in fast
    assert "with admission (not ranked: served 512-byte prompts, the others 200)" in slow
