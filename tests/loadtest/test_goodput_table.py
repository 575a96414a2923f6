"""The report's admission table: per scheme, the goodput ratio and refusals per good request at the
most users, the two figures issue 22 set goals for (pure logic: no server, no plotting)."""

from __future__ import annotations

import pytest

from loadtest.report.analysis import goodput_ratio, refusals_per_good
from loadtest.report.tables import goodput_section
from loadtest.study.results import Results


def load(goodput: list[float], refused: list[float]) -> dict[str, dict[str, float]]:
    return {
        str(users): {"goodput_per_s": g, "refused_per_s": r, "ttft_p50_s": 0.1}
        for users, g, r in zip((1, 8, 16, 32), goodput, refused, strict=True)
    }


def test_the_table_shows_the_goodput_ratio_and_refusals_per_good_request_per_scheme() -> None:
    results = Results.from_dict(
        {
            "run_id": "test",
            "environment": {},
            "schemes": ["learned", "alibi"],
            "config": {"admission_ttft_slo_s": 0.4},
            "load": {"learned": load([14, 26, 27, 1], [0] * 4), "alibi": load([7, 0.3, 0.2, 0.3], [0] * 4)},
            "load_admission": {
                "learned": load([15, 26, 26, 24], [0, 0, 5, 30]),
                "alibi": load([7, 8, 8, 6], [0, 9, 12, 24]),
            },
        }
    )
    section = goodput_section(results)
    assert "refusals per good request @32" in section and "goodput ratio" in section
    assert "| learned | 0.04 | 0.92 | - | 24.00 | 30.0 | 1.25 |" in section
    assert "| alibi | 0.04 | 0.75 | - | 6.00 | 24.0 | 4.00 |" in section
    assert "Short of the 0.8 goal with admission: alibi by 0.05" in section


def test_ratios_of_nothing_are_missing_not_zero() -> None:
    assert goodput_ratio({"1": {"goodput_per_s": 0.0}, "32": {"goodput_per_s": 0.0}}) is None
    assert refusals_per_good({"goodput_per_s": 0.0, "refused_per_s": 5.0}) is None
    assert refusals_per_good({"goodput_per_s": 4.0, "refused_per_s": 6.0}) == pytest.approx(1.5)
