"""The report's opening: one short verdict per scheme for each question the study asks, each with
the figure (and interval) behind it and a link to its section, and a headline table narrow enough
for a laptop screen. Everything else in the report is the evidence, after it."""

from __future__ import annotations

from loadtest.report.analysis import (
    GOODPUT_RATIO_GOAL,
    goodput_ratio,
    largest,
    latency_spreads,
    load_spreads,
    pooled,
)
from loadtest.report.formatting import cell, fmt
from loadtest.report.reuse_tables import scheme_verdict
from loadtest.study.results import Results
from loadtest.study.rounds import compared, goodput_ratio_rounds

EXTRAPOLATES = 1.15  # bits per byte at the longest servable multiple within 15% of 1x (the report's rule)
# Links into the sections that hold each verdict's table and figure (their headings' anchors).
QUESTIONS = {
    "quality at and beyond the training length": "#headline",
    "retrieval over distance": "#retrieval-over-distance",
    "cache memory": "#memory",
    "latency and goodput under load": "#goodput-without-and-with-admission-control",
    "reuse across requests": "#kv-reuse-a-shared-prefix-and-documents-in-varying-order",
}


def quality_verdict(results: Results, scheme: str) -> str:
    quality = {m: v for m, v in results.quality.get(scheme, {}).items() if v is not None}
    if "1" not in quality:
        return "not measured"
    longest = max(quality, key=float)
    at_one, at_longest = quality["1"], quality[longest]
    if longest == "1":
        return f"{at_one:.3f} bits/byte at 1x; no positions past it"
    change = at_longest / at_one
    word = "extrapolates" if change <= EXTRAPOLATES else "does not extrapolate"
    return f"{word}: {at_one:.3f} bits/byte at 1x, {at_longest:.3f} at {longest}x ({change - 1:+.0%})"


def retrieval_verdict(results: Results, scheme: str) -> str:
    copy = results.probe(scheme, "copy")
    near, far = pooled(copy, 128), largest(copy)
    if near is None:
        return "not measured"
    far_bytes = max((int(d) for d, c in copy.items() if c is not None), default=0)
    if far is None or far_bytes <= 128:
        return f"copies {cell(near)} within 128 bytes; no positions farther"
    return f"copies {cell(near)} within 128 bytes, {cell(far)} at {far_bytes} bytes"


def memory_verdict(results: Results, scheme: str) -> str:
    info = results.models.get(scheme)
    if info is None:
        return "not measured"
    text = f"{info['kv_bytes_per_token']} B/token"
    figures = results.cache_budget.get(scheme)
    if figures:
        window = figures["bpb"].get("window:256", {})
        longest = max(window, key=float, default=None)
        if longest is not None and window[longest] is not None:
            text += f"; window:256 keeps {fmt(window[longest])} bits/byte at {longest}x"
    return text


def load_verdict(results: Results, scheme: str) -> str:
    """Goodput with admission at the most users and its ratio to the best at fewer users (on the rounds'
    medians, with the rounds' range), and inter-token latency at the longest context, each against
    the best scheme's: "within noise" where the rounds' ranges overlap."""
    shed = results.load_admission.get(scheme, {})
    users = max(shed, key=int, default=None)
    if users is None:
        return "not measured"
    rounds = results.load_rounds.get("load_admission", {}).get(scheme)
    if not rounds:  # a run from before rounds: one sample per level
        ratio = goodput_ratio(shed)
        ratio_text = "" if ratio is None else f", {ratio:.2f} of its best at fewer users"
        top = shed[users]
        return (
            f"{top['goodput_per_s']:.2f} good req/s at {users} users with admission{ratio_text} "
            f"(p99 {top['p99_s']:.2f} s; one sample per level)"
        )
    goodput = load_spreads(results, "load_admission", users, "goodput_per_s")
    ratio, ratio_rounds = goodput_ratio_rounds(rounds)
    text = f"{goodput[scheme].text()} good req/s at {users} users with admission ({compared(goodput, True)[scheme]})"
    if ratio is not None:
        text += f", {ratio:.2f} of its best at fewer users"
        if ratio_rounds is not None and ratio_rounds.rounds > 1:
            text += f" (rounds {ratio_rounds.low:.2f}-{ratio_rounds.high:.2f})"
        if ratio < GOODPUT_RATIO_GOAL:
            text += f", short of the {GOODPUT_RATIO_GOAL:g} goal by {GOODPUT_RATIO_GOAL - ratio:.2f}"
    contexts = {c for s in results.schemes for c in results.latency_rounds.get("itl", {}).get(s, {})}
    longest = max(contexts, key=int, default=None)
    itl = latency_spreads(results, "itl", longest) if longest else {}
    if scheme in itl:
        text += f"; ITL {itl[scheme].text(2, 1000)} ms at {longest} bytes ({compared(itl, False)[scheme]})"
    return f"{text}; medians of {goodput[scheme].rounds} rounds [min-max]"


def reuse_verdict(results: Results, scheme: str) -> str:
    return scheme_verdict(results, scheme) or "not measured"


VERDICTS = (quality_verdict, retrieval_verdict, memory_verdict, load_verdict, reuse_verdict)


def findings_section(results: Results) -> str:
    """## Findings: per question, one line per scheme."""
    blocks = []
    for (question, anchor), verdict in zip(QUESTIONS.items(), VERDICTS, strict=True):
        lines = "\n".join(f"- **{scheme}**: {verdict(results, scheme)}" for scheme in results.schemes)
        blocks.append(f"**[{question.capitalize()}]({anchor})**\n\n{lines}\n")
    if results.speculative:
        lines = "\n".join(
            f"- **{scheme}**: {cells['repeats@1']['speedup']:.2f}x tokens/s on code with repeats at one stream "
            f"({cells['repeats@1']['acceptance']:.0%} of guesses kept)"
            for scheme, cells in results.speculative.items()
            if "repeats@1" in cells
        )
        blocks.append(f"**[Speculative decoding](#speculative-decoding-what-guessing-buys-each-scheme)**\n\n{lines}\n")
    return "## Findings\n\n" + "\n".join(blocks)


def compact_headline(results: Results) -> str:
    """Eight columns: quality at 1x and at the longest multiple, far copy and passkey, goodput and p99
    at the most users, KV bytes per token (every column of the old headline is in the appendix)."""
    multiples = sorted({m for s in results.schemes for m in results.quality.get(s, {})}, key=float)
    longest = multiples[-1] if multiples else "8"
    users = sorted({u for s in results.schemes for u in results.load.get(s, {})}, key=int)
    top = users[-1] if users else None
    header = ["scheme", "bpb@1x", f"bpb@{longest}x", f"copy @{longest}x", f"passkey @{longest}x",
              f"goodput req/s @{top}", f"p99 s @{top}", "KV B/token"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for scheme in results.schemes:
        quality = results.quality.get(scheme, {})
        load = results.load.get(scheme, {}).get(top, {}) if top else {}
        info = results.models.get(scheme)
        cells = [
            scheme, fmt(quality.get("1")), fmt(quality.get(longest)),
            cell(largest(results.probe(scheme, "copy"))), cell(largest(results.probe(scheme, "passkey"))),
            fmt(load.get("goodput_per_s"), 2), fmt(load.get("p99_s"), 2),
            "" if info is None else str(info["kv_bytes_per_token"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
