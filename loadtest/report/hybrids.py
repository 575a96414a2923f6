"""The Findings' paragraph on the hybrids: what each local/global hybrid costs and buys against rope,
relative and alibi, question by question, from whatever the run measured (a section not yet measured
for it says so rather than leaving the question out)."""

from __future__ import annotations

from loadtest.report.analysis import largest
from loadtest.report.formatting import cell
from loadtest.report.reuse_tables import judge, mode_changes
from loadtest.report.seeds import label
from loadtest.study.results import Results, Reuse
from models.positional import SCHEME_REGISTRY, LocalGlobalHybrid

RIVALS = ("rope", "relative", "alibi")
QUALITY_CLOSE = 0.03  # the bar: bits per byte at the training length within 3% of rope's


def hybrid_schemes(results: Results) -> list[str]:
    """The run's schemes whose local layers see a sliding window (models.positional.LocalGlobalHybrid)."""
    return [s for s in results.schemes if issubclass(SCHEME_REGISTRY.get(s, object), LocalGlobalHybrid)]


def quality_summary(results: Results, hybrid: str, rivals: tuple[str, ...] = RIVALS) -> str:
    own = results.quality.get(hybrid, {})
    if own.get("1") is None:
        return "quality not measured"
    longest = max((m for m, v in own.items() if v is not None), key=float)
    parts = []
    for rival in rivals:
        theirs = results.quality.get(rival, {})
        if theirs.get("1") is None:
            continue
        text = f"{own['1'] / theirs['1'] - 1:+.1%} of {rival}'s at 1x"
        if theirs.get(longest) is not None and longest != "1":
            text += f", {own[longest] / theirs[longest] - 1:+.1%} at {longest}x"
        parts.append(text)
    close = results.quality.get("rope", {}).get("1")
    verdict = "" if close is None else (
        " (within 3% of rope at the training length)" if abs(own["1"] / close - 1) <= QUALITY_CLOSE
        else " (**not** within 3% of rope at the training length)"
    )
    return f"{own['1']:.3f} bits/byte at 1x, {own[longest]:.3f} at {longest}x: " + "; ".join(parts) + verdict


def retrieval_summary(results: Results, hybrid: str, rivals: tuple[str, ...] = RIVALS) -> str:
    if hybrid not in results.retrieval:
        return "retrieval not measured"
    parts = []
    for probe in ("copy", "passkey"):
        found = largest(results.probe(hybrid, probe))
        if found is None:
            continue
        far = max(int(k) for k, v in results.probe(hybrid, probe).items() if v is not None and k != "all")
        against = ", ".join(f"{r} {cell(c)}" for r in rivals if r in results.retrieval
                            and (c := results.probe(r, probe).get(str(far))) is not None)  # fmt: skip
        unit = "bytes apart" if probe == "copy" else "bytes of context"
        parts.append(f"{probe} {cell(found)} at {far} {unit}" + (f" (against {against})" if against else ""))
    return "; ".join(parts) or "retrieval not measured"


def _memory(results: Results, hybrid: str) -> str:
    own, rope = results.kv_footprint.get(hybrid), results.kv_footprint.get("rope")
    if not own or not rope:
        return "memory footprint not measured"
    lengths = sorted((k.split("@")[1] for k in own if k.startswith("kv_bytes")), key=int)
    per_token = ", ".join(
        f"{own[f'kv_bytes_per_token@{n}'] / rope[f'kv_bytes_per_token@{n}']:.2f}x at {n}" for n in lengths
        if f"kv_bytes_per_token@{n}" in rope
    )
    text = f"K/V bytes per token {per_token} tokens of rope's (relative and alibi hold rope's bytes)"
    if "requests_4kb@budget" in own and rope.get("requests_4kb@budget"):
        text += (f"; one budget holds {own['requests_4kb@budget']:.0f} 4 KB requests at once against rope's "
                 f"{rope['requests_4kb@budget']:.0f}")  # fmt: skip
    return text


def _budget_load(results: Results, hybrid: str) -> str:
    own, rope = results.load_budget.get(hybrid), results.load_budget.get("rope")
    if not own or not rope:
        return ""
    return (f" Under one KV budget with 4 KB prompts it ran {own.get('running_peak', 0):.0f} requests at once "
            f"against rope's {rope.get('running_peak', 0):.0f}, for {own['goodput_per_s']:.2f} good req/s and "
            f"{own['tokens_per_s']:.0f} tokens/s against {rope['goodput_per_s']:.2f} and {rope['tokens_per_s']:.0f}.")


def latency_summary(results: Results, hybrid: str, rivals: tuple[str, ...] = RIVALS) -> str:
    """Inter-token latency at the longest context the run measured for the hybrid and its rivals."""
    own = results.itl.get(hybrid, {})
    if not own:
        return ""
    longest = max(own, key=int)
    against = ", ".join(f"{own[longest] / theirs[longest]:.2f}x {rival}'s" for rival in rivals
                        if (theirs := results.itl.get(rival, {})).get(longest))  # fmt: skip
    text = f" Latency: inter-token {own[longest] * 1000:.2f} ms at {longest} bytes of context"
    return text + (f" ({against})." if against else ".")


def speculation_summary(results: Results, hybrid: str, rivals: tuple[str, ...] = RIVALS) -> str:
    """Speculation's speedup at one stream on code with repeats, against the rivals'."""
    own = results.speculative.get(hybrid, {}).get("repeats@1")
    if own is None:
        return ""
    against = ", ".join(f"{rival} {theirs['speedup']:.2f}x" for rival in rivals
                        if (theirs := results.speculative.get(rival, {}).get("repeats@1")))  # fmt: skip
    return f" Speculation: {own['speedup']:.2f}x at one stream" + (f" (against {against})." if against else ".")


def _placed(reuse: Reuse, form: str) -> str | None:
    """A scheme's reused documents' change over the full recompute as it places them, with its interval
    ("no baseline" where the full recompute does not retrieve; None: not measured)."""
    kind, _ = judge(reuse, form)
    change = (mode_changes(reuse, form) or {}).get(reuse["segment_reuse"])
    if kind == "no baseline":
        return "no baseline (the full recompute does not retrieve)"
    return None if change is None or kind == "not measured" else cell_change(change)


def reuse_summary(results: Results, hybrid: str, rivals: tuple[str, ...] = RIVALS) -> str:
    """Reused documents' cost over the full recompute, as each scheme places them, against the rivals'."""
    own = results.reuse.get(hybrid)
    if own is None:
        return ""
    parts = []
    for form in own["documents"]:
        placed = _placed(own, form)
        if placed is None:
            continue
        against = ", ".join(f"{rival} {theirs.split(' [')[0].split(' (')[0]}" for rival in rivals
                            if rival in results.reuse and (theirs := _placed(results.reuse[rival], form)))  # fmt: skip
        parts.append(f"{form} documents {placed}" + (f" (against {against})" if against else ""))
    how = "as is" if own["segment_reuse"] == "as_is" else "re-rotated"
    return f" Reuse ({how}, bits per byte over the full recompute): {'; '.join(parts)}." if parts else ""


def cell_change(change: dict[str, float]) -> str:
    """A relative change with its interval: '+2.3% [+1.2, +3.5]'."""
    return f"{change['value']:+.1%} [{change['low'] * 100:+.1f}, {change['high'] * 100:+.1f}]"


def not_measured_summary(results: Results, hybrid: str) -> str:
    missing = [name for name, section in (("latency", results.itl), ("speculation", results.speculative),
                                          ("reuse", results.reuse), ("load under one KV budget", results.load_budget))
               if hybrid not in section]  # fmt: skip
    return "" if not missing else f" Not yet measured for it in this report: {', '.join(missing)}."


def hybrids_section(results: Results) -> str:
    """One paragraph per hybrid, or nothing when the run has none."""
    hybrids = hybrid_schemes(results)
    if not hybrids:
        return ""
    blocks = []
    for hybrid in hybrids:
        blocks.append(
            f"- **{label(results, hybrid)}**: quality {quality_summary(results, hybrid)}. Retrieval: "
            f"{retrieval_summary(results, hybrid)}. Memory: {_memory(results, hybrid)}.{_budget_load(results, hybrid)}"
            f"{latency_summary(results, hybrid)}{speculation_summary(results, hybrid)}{reuse_summary(results, hybrid)}"
            f"{not_measured_summary(results, hybrid)}"
        )
    return (
        "**What the hybrids cost and buy** (the served seed-1234 models' figures; the verdicts above give "
        "each scheme's range over its seeds. Local sliding-window RoPE layers with one global layer, against "
        + ", ".join(RIVALS) + ")\n\n" + "\n".join(blocks) + "\n"
    )
