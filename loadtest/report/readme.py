"""The README's findings table, generated from a comparison's results.json so that the README says
what the reference report measured (tests/test_readme.py holds the two together):
`python -m loadtest.report reports/reference --readme-table` prints it.

Each cell is read at a glance (at most CELL_LIMIT characters): a verdict word and its figure. A
scheme with several training seeds shows their mean with their range (lowest to highest seed), and
its verdict holds on every seed unless the cell says "seeds disagree", a link to the report's
section that keeps each seed's figures. Under the table, one sentence per column says what it
measures.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from loadtest.report.analysis import largest
from loadtest.report.findings import (
    EXTRAPOLATES,
    Judgement,
    copy_judgement,
    judged,
    placed_change,
    quality_judgement,
    seeded_bpb,
    speculative_judgement,
    value_of,
)
from loadtest.report.reuse_tables import judge, mode_changes
from loadtest.report.seeds import AcrossSeeds, across, label, many_seeds
from loadtest.report.speculative_tables import SPEEDUP_GAIN
from loadtest.study.results import Results

CELL_LIMIT = 60  # characters of a cell's Markdown: what a reader takes in at a glance
REPORT = "reports/reference/report.md"  # where the README's links point (docs/index.md: one folder up)
HEADER = (
    "| scheme | bits/byte at 1x | at 8x the training length | copies 16 bytes 8x away | a reused document's answer "
    "vs recomputing it | speculative decoding, code with repeats |\n|---|---|---|---|---|---|"
)
# The report's section that keeps each column's figures seed by seed: "seeds disagree" links there.
SEED_SECTIONS = {
    "quality": "Headline",
    "copy": "Retrieval over distance",
    "reuse": "What reuse buys each scheme (the answer's bpb within 1% of the full recompute)",
    "speculative": "Speculative decoding: what guessing buys each scheme",
}
DISAGREE = "[seeds disagree][{}-seeds]"
# Verdict words as a cell says them (the report's sentences say more).
SHORT_WORDS = {f"gains little (< {SPEEDUP_GAIN:g}x)": "gains little", "gains from guessing": "gains"}
PLACEMENT = {"as_is": "as is", "rotate": "re-rotated"}


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs write it: lower case, punctuation dropped, spaces as '-'."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading.strip().lower()))


# How each column writes its figure (AcrossSeeds.text: one seed's value, or the seeds' mean and range).
FIGURE_TEXT: dict[str, Callable[[AcrossSeeds], str]] = {
    "quality": lambda figure: figure.text(3),
    "copy": lambda figure: figure.text(2),
    "reuse": lambda figure: figure.text(1, 100, "%", sign=True),
    "speculative": lambda figure: figure.text(2, unit="x"),
}


def seeded_cell(said: dict[str, Judgement], column: str, figure: AcrossSeeds | None) -> str:
    """'<verdict>: <figure>' where the seeds agree (one seed: its verdict), else 'seeds disagree'
    (a link to the report's seed-by-seed section) with the figure over the seeds."""
    text = "not measured" if figure is None else FIGURE_TEXT[column](figure)
    kinds = {kind for kind, _ in said.values()}
    if len(kinds) > 1:
        return f"{DISAGREE.format(column)}: {text}"
    if not kinds:
        return text
    kind = next(iter(kinds))
    return f"{SHORT_WORDS.get(kind, kind)}: {text}"


def far_cell(results: Results, scheme: str) -> str:
    """Bits per byte at the longest multiple, with whether it extrapolates."""
    longest = max((m for m, v in results.quality.get(scheme, {}).items() if v is not None), key=float, default="1")
    positions = results.models.get(scheme, {}).get("max_positions")
    if longest == "1" or results.quality.get(scheme, {}).get("8") is None:
        return f"not servable ({positions} positions)" if positions else "not servable"
    said = judged(results, scheme, results.quality, lambda model: quality_judgement(results, model))
    figure = across(results, scheme, results.quality, lambda m: results.quality[m].get("8"))
    return seeded_cell(said, "quality", figure)


def copy_cell(results: Results, scheme: str) -> str:
    found = across(results, scheme, results.retrieval, lambda m: value_of(largest(results.probe(m, "copy"))))
    if found is None:
        return "not servable"
    said = judged(results, scheme, results.retrieval, lambda model: copy_judgement(results, model))
    return seeded_cell(said, "copy", found)


def reuse_cell(results: Results, scheme: str, form: str) -> str:
    """A short document's verdict and change from the full recompute: on one seed with its paired 95%
    interval, on several their mean and range."""
    reuse = results.reuse.get(scheme)
    if reuse is None:
        return "not measured"
    kind, _ = judge(reuse, form)
    if kind == "recomputes":
        return "no: recomputed"
    if kind in ("no baseline", "not measured"):
        return kind
    models = judged(results, scheme, results.reuse, lambda m: (judge(results.reuse[m], form)[0], ""))
    if len(models) < 2:
        change = (mode_changes(reuse, form) or {}).get(reuse["segment_reuse"])
        assert change is not None
        return f"{kind}: {change['value']:+.1%} [{change['low'] * 100:+.1f}, {change['high'] * 100:+.1f}]"
    spread = across(results, scheme, results.reuse, lambda m: placed_change(results, m, form))
    return seeded_cell(models, "reuse", spread)


def speculative_cell(results: Results, scheme: str) -> str:
    found = across(
        results, scheme, results.speculative, lambda m: results.speculative[m].get("repeats@1", {}).get("speedup")
    )
    if found is None:
        return "not measured"
    said = judged(results, scheme, results.speculative, lambda model: speculative_judgement(results, model))
    return seeded_cell(said, "speculative", found)


def table_rows(results: Results, form: str = "short") -> list[list[str]]:
    """Each scheme's cells, in the header's order."""
    cells: list[Callable[[Results, str], str]] = [
        label, lambda r, s: seeded_bpb(r, s, "1"), far_cell, copy_cell,
        lambda r, s: reuse_cell(r, s, form), speculative_cell,
    ]  # fmt: skip
    return [[cell(results, scheme) for cell in cells] for scheme in results.schemes]


def readme_table(results: Results, report: str = REPORT, form: str = "short") -> str:
    """The table, the links its "seeds disagree" cells use (into `report`), and what each column measures."""
    rows = table_rows(results, form)
    lines = [HEADER, *("| " + " | ".join(row) + " |" for row in rows)]
    used = [column for column in SEED_SECTIONS if any(DISAGREE.format(column) in c for row in rows for c in row)]
    links = [f"[{column}-seeds]: {report}#{anchor(SEED_SECTIONS[column])}" for column in used]
    return "\n".join(lines) + "\n\n" + ("\n".join(links) + "\n\n" if links else "") + column_notes(results, form)


def placements(results: Results) -> str:
    """'as is: relative, alibi; re-rotated: rope' over the schemes that reuse documents."""
    by: dict[str, list[str]] = {}
    for scheme in results.schemes:
        placement = results.reuse.get(scheme, {}).get("segment_reuse")
        if placement in PLACEMENT:
            by.setdefault(PLACEMENT[placement], []).append(scheme)
    return "; ".join(f"{how}: {', '.join(schemes)}" for how, schemes in by.items())


def column_notes(results: Results, form: str = "short") -> str:
    """One sentence per column: what it measures and what its verdict word means."""
    context = results.train_context
    documents = {s: r["documents"][form] for s, r in results.reuse.items() if form in r.get("documents", {})}
    size = next((f["document_bytes"] for f in documents.values() if "document_bytes" in f), None)
    seeds = ("; a figure over several seeds is their mean with their range, lowest to highest seed, in "
             "parentheses, and its verdict holds on every seed unless the cell says seeds disagree (a link to the "
             "report's seed-by-seed figures)" if many_seeds(results) else "")  # fmt: skip
    notes = [
        ("scheme", f"the positional scheme, with how many training seeds its row rests on{seeds}."),
        ("bits/byte at 1x", f"bits per byte of held-out stdlib code at the {context}-byte training context, through "
         "the `Score` RPC (lower is better)."),
        ("at 8x", f"the same at {8 * context:,} bytes: extrapolates where it stays within "
         f"{EXTRAPOLATES - 1:.0%} of the 1x figure."),
        ("copies", f"the share of a planted 16-byte span's repeat predicted with {8 * context:,} bytes between the "
         "copies: retrieves far where it keeps half its share within 128 bytes and beats chance, copies, not far "
         "where only the near copies do, does not copy where not even those beat chance."),
        ("reused document", f"no where positions enter every layer's input (the server recomputes the document), else "
         "a "
         f"{size or 'short'}-byte document reused at another offset ({placements(results)}) "
         "against recomputing the prompt, the answer's bits per byte with its paired 95% interval: within 1% "
         "only when the interval lies inside +-1%, cannot when wholly above +1%, reads better when wholly "
         "below -1%, needs repair k = N when recomputing its first N tokens brings it within 1%, and no "
         "baseline where the recompute itself does not retrieve."),
        ("speculative decoding", "tokens/s with 16 n-gram guesses a step over tokens/s without, on code with "
         f"repeats at one stream: gains from {SPEEDUP_GAIN:g}x up."),
    ]  # fmt: skip
    return "What each column measures:\n\n" + "\n".join(f"- **{name}**: {text}" for name, text in notes) + "\n"
