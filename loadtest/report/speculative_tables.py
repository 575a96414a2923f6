"""The report's speculative-decoding section: what guessing buys each scheme, and whether it follows
how well the scheme copies (the retrieval section's copy probe)."""

from __future__ import annotations

from collections.abc import Callable

from loadtest.report.seeds import label
from loadtest.study.results import Results, SpeculativeCell

COPY_FILLER = "256"  # the copy probe's filler closest to the repeats workload's copy distance (~320 bytes)
# A speedup below this is what reruns move it by (sinusoidal read 0.98x and 1.03x, rope 1.08x and 1.13x at one
# stream on code with repeats in two reference runs): "gains from guessing" from here up.
SPEEDUP_GAIN = 1.2
CELLS = ("repeats@1", "held-out@1", "repeats@16", "held-out@16")  # the table's columns


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None with fewer than 3 points."""
    if len(xs) < 3:
        return None

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx and vy else None


def copy_accuracy(results: Results, model: str) -> float | None:
    cell = results.probe(model, "copy").get(COPY_FILLER)
    return None if not cell else float(cell["value"])


def acceptance_text(cell: SpeculativeCell | None) -> str:
    """'2.25x (61% [55%, 66%])': the speedup and the share of guesses kept, with its interval over prompts
    where the run measured one."""
    if cell is None:
        return "-"
    interval = cell.get("acceptance_interval")
    kept = f"{cell['acceptance']:.0%}" + (f" [{interval['low']:.0%}, {interval['high']:.0%}]" if interval else "")
    return f"{cell['speedup']:.2f}x ({kept})"


def mean_over_seeds(results: Results, scheme: str, figure: Callable[[str], float | None]) -> float | None:
    """The mean of `figure` over the scheme's training seeds the speculative section measured."""
    values = [v for model in results.seeded(scheme, results.speculative).values() if (v := figure(model)) is not None]
    return sum(values) / len(values) if values else None


def speculative_section(results: Results) -> str:
    """The section's markdown, or nothing where the run did not measure it."""
    if not results.speculative:
        return ""
    rows = []
    for scheme in results.schemes:
        for model in results.seeded(scheme, results.speculative).values():
            cells = results.speculative[model]
            figures = [
                acceptance_text(cells.get(key)) for key in ("repeats@1", "held-out@1", "repeats@16", "held-out@16")
            ]
            copy = copy_accuracy(results, model)
            shown = label(results, model) if model == scheme else model
            rows.append(f"| {shown} | " + " | ".join(figures) + f" | {'-' if copy is None else f'{copy:.2f}'} |")
    pairs = [
        (accepted, copy)
        for scheme in results.schemes
        if (accepted := mean_over_seeds(results, scheme,
                                        lambda m: results.speculative[m].get("repeats@1", {}).get("acceptance")))
        is not None and (copy := mean_over_seeds(results, scheme, lambda m: copy_accuracy(results, m))) is not None
    ]  # fmt: skip
    rho = spearman([a for a, _ in pairs], [c for _, c in pairs]) if pairs else None
    follows = (
        "not measured (the run has no copy probe)"
        if rho is None
        else f"Spearman's rank correlation across schemes {rho:+.2f} ({len(pairs)} schemes; a scheme with several "
        "training seeds by their means)"
    )
    table = "\n".join(rows)
    counts = {int(cell.get("guesses", 8)) for cells in results.speculative.values() for cell in cells.values()}
    guesses = " or ".join(str(n) for n in sorted(counts)) or "8"  # runs before the count was kept: 8
    return f"""## Speculative decoding: what guessing buys each scheme

Tokens/s with {guesses} n-gram (prompt-lookup) guesses a step over tokens/s without, and the share of guesses
kept (with its 95% interval over prompts where measured: each prompt is its own held-out code), through the
service (greedy, ignore_eos, the same prompts with and without, alternated). "repeats":
held-out code followed by its first third again, so what follows is a copy; "held-out": held-out code
alone. 16 streams: a server that guesses at any batch size (the default `--speculative-max-batch 1`
keeps it off there). The output is the same with and without: only its speed changes.

| model | repeats, 1 stream | held-out, 1 stream | repeats, 16 streams | held-out, 16 streams | copy {COPY_FILLER} B |
|---|---|---|---|---|---|
{table}

Whether acceptance follows the copy probe (repeats at 1 stream against the copy probe's accuracy at
{COPY_FILLER} filler bytes): {follows}.

"""
