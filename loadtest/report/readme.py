"""The README's findings table, generated from a comparison's results.json so that the README says
what the reference report measured (tests/test_readme.py holds the two together):
`python -m loadtest.report reports/reference --readme-table` prints it.

A scheme with several training seeds shows their mean with their range (lowest to highest seed);
its reuse cell keeps the served model's paired interval (the served prompt sample's) and adds the
seeds' range and whether their verdicts agree.
"""

from __future__ import annotations

from loadtest.report.analysis import largest, pooled
from loadtest.report.findings import placed_change, seeded_bpb, value_of
from loadtest.report.reuse_tables import judge, mode_changes
from loadtest.report.seeds import across, agreement, label, seed_models
from loadtest.study.results import Results

HEADER = (
    "| scheme | bits/byte at 1x | at 8x the training length | copies 16 bytes 8x away | a reused document's answer "
    "vs recomputing it | speculative decoding, code with repeats |\n|---|---|---|---|---|---|"
)
# A reuse verdict's word after the figure (cannot: the figure says it).
VERDICT_WORDS = {
    "within 1%": ", within 1%",
    "reads better": ", reads better",
    "undecided": ", undecided",
    "cannot": "",
    "cannot as placed": "",
}


def readme_table(results: Results, form: str = "short") -> str:
    rows = [HEADER]
    for scheme in results.schemes:
        info = results.models.get(scheme, {})
        far, positions = seeded_bpb(results, scheme, "8"), info.get("max_positions")
        if far == "not servable" and positions:
            far = f"not servable ({positions} positions)"
        cells = [label(results, scheme), seeded_bpb(results, scheme, "1"), far, copy_cell(results, scheme),
                 reuse_cell(results, scheme, form), speculative_cell(results, scheme)]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def copy_cell(results: Results, scheme: str) -> str:
    found = across(results, scheme, results.retrieval, lambda m: value_of(largest(results.probe(m, "copy"))))
    if found is None:
        return "not servable"
    near = pooled(results.probe(scheme, "copy"), 128)
    never = near is not None and near["low"] <= results.span_chance
    return found.text(2) + (" (never copies)" if never else "")


def reuse_cell(results: Results, scheme: str, form: str) -> str:
    reuse = results.reuse.get(scheme)
    if reuse is None:
        return "not measured"
    kind, _ = judge(reuse, form)
    placement = reuse["segment_reuse"]
    how = {"as_is": "as is", "rotate": "re-rotated"}.get(placement, "")
    if kind == "recomputes":
        return "no: recomputed"
    if kind in ("no baseline", "not measured"):
        return f"{how} ({kind})"
    change = (mode_changes(reuse, form) or {}).get(placement)
    assert change is not None
    interval = f"{change['value']:+.1%} [{change['low'] * 100:+.1f}, {change['high'] * 100:+.1f}]"
    text = f"{how}: {interval}{VERDICT_WORDS.get(kind, f', {kind}')}"
    models = seed_models(results, scheme, results.reuse)
    if len(models) < 2:
        return text
    spread = across(results, scheme, results.reuse, lambda m: placed_change(results, m, form))
    said = agreement({seed: judge(results.reuse[model], form)[0] for seed, model in models.items()})
    return f"{text}; over seeds {'-' if spread is None else spread.text(1, 100, '%', sign=True)}, {said}"


def speculative_cell(results: Results, scheme: str) -> str:
    found = across(
        results, scheme, results.speculative, lambda m: results.speculative[m].get("repeats@1", {}).get("speedup")
    )
    return "not measured" if found is None else found.text(2, unit="x")
