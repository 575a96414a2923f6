"""Figures the docs copy from the reference report are held to reports/reference/results.json, so a
rerun of the report cannot leave the docs quoting the run before (issue 53: reference.md once said
rope +2.6% and alibi +18.5% where the report said otherwise)."""

from __future__ import annotations

import re

import pytest

from contract.paths import REPOSITORY_ROOT
from loadtest.report.findings import compact_headline
from loadtest.report.readme import readme_table
from loadtest.report.reuse_tables import judge, mode_changes
from loadtest.report.tables import headline_table
from loadtest.study.results import Results

DOCS = REPOSITORY_ROOT / "docs"
RESULTS = REPOSITORY_ROOT / "reports" / "reference" / "results.json"
# A reuse verdict that quotes the placed reuse's change (the others say "recomputed" or "no baseline").
QUOTED = ("within 1%", "reads better", "undecided", "cannot", "cannot as placed")
# The reference page's reuse table: the column of each document length's form.
REUSE_COLUMNS = {"short": 4, "long": 5}


@pytest.fixture(scope="module")
def results() -> Results:
    return Results.read(RESULTS)


def test_the_site_opens_with_the_findings_table(results: Results) -> None:
    """index.md's first table is the README's findings table, generated from the results."""
    text = (DOCS / "index.md").read_text()
    table = readme_table(results, "../reports/reference/report.md")
    assert table in text
    assert text.index(table) < text.index("Where to start")
    assert text.index("| scheme") == text.index(table)  # no other table before it


def test_the_reference_page_s_headline_is_the_report_s(results: Results) -> None:
    assert headline_table(results) in (DOCS / "reference.md").read_text()


def interval(change: dict[str, float]) -> str:
    return f"{change['value']:+.1%} [{change['low'] * 100:+.1f}, {change['high'] * 100:+.1f}]"


def test_the_reference_page_s_reuse_intervals_are_the_report_s(results: Results) -> None:
    """Each scheme's row of the reuse table quotes, for short and long documents, the interval of
    its declared placement as the results hold it."""
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[1:-1]]
        for line in (DOCS / "reference.md").read_text().splitlines()
        if re.match(r"\| [\w-]+ \| `(as_is|rotate|recompute)` \|", line)
    }
    quoted = 0
    for scheme, reuse in ((s, results.reuse[s]) for s in results.schemes if s in results.reuse):
        for form, column in REUSE_COLUMNS.items():
            change = (mode_changes(reuse, form) or {}).get(reuse["segment_reuse"])
            if judge(reuse, form)[0] in QUOTED and change is not None:
                assert interval(change) in rows[scheme][column], (scheme, form)
                quoted += 1
    assert quoted >= 4


def test_the_report_s_headline_says_its_goodput_is_without_admission(results: Results) -> None:
    for table in (compact_headline(results), headline_table(results)):
        header = table.splitlines()[0]
        assert "goodput req/s @32, no admission" in header


def span(values: list[float], digits: int, scale: float = 1.0) -> str:
    """`low-high` as the prose writes a range (thousands with a comma)."""
    low, high = (f"{v * scale:,.{digits}f}" for v in (min(values), max(values)))
    return f"{low}-{high}"


def test_the_reference_page_s_load_and_latency_prose_is_the_headline_run_s(results: Results) -> None:
    """The ranges the prose quotes from the latency and load columns: decode at 2048 bytes, tokens/s
    and goodput at 32 users without admission, goodput with admission at 8-32 users."""
    text = " ".join((DOCS / "reference.md").read_text().split())
    unbounded = [s for s in results.schemes if results.itl.get(s, {}).get("2048") is not None]
    top = {s: results.load[s]["32"] for s in unbounded}
    admitted = [results.load_admission[s][u]["goodput_per_s"] for s in unbounded for u in ("8", "16", "32")]
    expected = {
        "decode at 2048 bytes": span([results.itl[s]["2048"] for s in unbounded], 2, 1000) + " ms per token",
        "tokens/s at 32": "Tokens/s at 32 users: " + span([top[s]["tokens_per_s"] for s in unbounded], 0),
        "goodput without admission": f"({span([top[s]['goodput_per_s'] for s in unbounded], 2)} requests/s at 32",
        "goodput with admission": span(admitted, 2) + " requests/s of goodput at 8-32 users",
    }
    missing = {name: figure for name, figure in expected.items() if figure not in text}
    assert missing == {}
