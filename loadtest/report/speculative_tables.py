"""The report's speculative-decoding section: what guessing buys each scheme, and whether it follows
how well the scheme copies (the retrieval section's copy probe)."""

from __future__ import annotations

from loadtest.study.results import Results

COPY_FILLER = "256"  # the copy probe's filler closest to the repeats workload's copy distance (~320 bytes)


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


def copy_accuracy(results: Results, scheme: str) -> float | None:
    cell = results.probe(scheme, "copy").get(COPY_FILLER)
    return None if not cell else float(cell["value"])


def speculative_section(results: Results) -> str:
    """The section's markdown, or nothing where the run did not measure it."""
    if not results.speculative:
        return ""
    rows = []
    for scheme, cells in results.speculative.items():
        figures = []
        for key in ("repeats@1", "held-out@1", "repeats@16", "held-out@16"):
            cell = cells.get(key)
            figures.append("-" if cell is None else f"{cell['speedup']:.2f}x ({cell['acceptance']:.0%})")
        copy = copy_accuracy(results, scheme)
        rows.append(f"| {scheme} | " + " | ".join(figures) + f" | {'-' if copy is None else f'{copy:.2f}'} |")
    pairs = [
        (cells["repeats@1"]["acceptance"], copy)
        for scheme, cells in results.speculative.items()
        if "repeats@1" in cells and (copy := copy_accuracy(results, scheme)) is not None
    ]
    rho = spearman([a for a, _ in pairs], [c for _, c in pairs]) if pairs else None
    follows = (
        "not measured (the run has no copy probe)"
        if rho is None
        else f"Spearman's rank correlation across schemes {rho:+.2f} ({len(pairs)} schemes)"
    )
    table = "\n".join(rows)
    counts = {int(cell.get("guesses", 8)) for cells in results.speculative.values() for cell in cells.values()}
    guesses = " or ".join(str(n) for n in sorted(counts)) or "8"  # runs before the count was kept: 8
    return f"""## Speculative decoding: what guessing buys each scheme

Tokens/s with {guesses} n-gram (prompt-lookup) guesses a step over tokens/s without, and the share of guesses
kept, through the service (greedy, ignore_eos, the same prompts with and without, alternated). "repeats":
held-out code followed by its first third again, so what follows is a copy; "held-out": held-out code
alone. 16 streams: a server that guesses at any batch size (the default `--speculative-max-batch 1`
keeps it off there). The output is the same with and without: only its speed changes.

| scheme | repeats, 1 stream | held-out, 1 stream | repeats, 16 streams | held-out, 16 streams | copy {COPY_FILLER} B |
|---|---|---|---|---|---|
{table}

Whether acceptance follows the copy probe (repeats at 1 stream against the copy probe's accuracy at
{COPY_FILLER} filler bytes): {follows}.

"""
