"""The report's cache-budget tables: the least KV memory that keeps quality (Memory section), and
quality, retrieval, int8 and cost per cache policy with the issue's hypotheses checked."""

from __future__ import annotations

from loadtest.report.analysis import (
    WITHIN,
    bpb_cell,
    bpb_multiples,
    cheapest_within,
    int8_ratio,
    probe_cell,
)
from loadtest.report.formatting import binary_bytes, cell, fmt
from loadtest.study.cache_budget import COST_HISTORY, policy_budget
from loadtest.study.results import CacheBudget, Results


def memory_section(results: Results) -> str:
    """The figure and, per scheme and length, the cheapest policy within WITHIN of the full cache."""
    data = results.cache_budget
    if not data:
        return "The cache-budget section was not measured in this run (`--sections cache`): no memory figure.\n"
    train, ratio = results.train_context, int8_ratio(data)
    multiples = bpb_multiples(data)
    lines = [f"| scheme | {' | '.join(f'{round(float(m) * train)} tokens ({m}x)' for m in multiples)} |",
             "|---|" + "---|" * len(multiples)]  # fmt: skip
    for model in [m for scheme in results.schemes for m in results.seeded(scheme, data).values()]:
        cells = []
        for m in multiples:
            chosen = cheapest_within(data.get(model), m, train, ratio)
            cells.append(
                "not servable" if chosen is None else f"{chosen[0]}: {binary_bytes(chosen[1])} ({chosen[2]:+.1%})"
            )
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    int8_lengths = sorted(
        {
            m
            for f in data.values()
            for p, cells in f.get("int8", {}).items()
            if p != "full"
            for m in cells
            if "@" not in m
        },
        key=float,
    )
    if int8_lengths:
        lines.append(f"\nThe int8 forms were measured at {', '.join(f'{m}x' for m in int8_lengths)} only.")
    return (
        "![KV bytes per sequence](kv_bytes.png)\n\n"
        f"The least KV memory per sequence that keeps bits per byte within {WITHIN:.0%} of the full cache "
        "(policy: bytes per sequence (bpb change against the full cache)), from the cache-budget "
        "measurements below. Bytes are the tokens a policy keeps times the model's K/V bytes per token "
        "(int8: times the measured int8/float32 allocation ratio"
        + (f", {ratio.unbounded:.3f}; a bounded +int8 row, with per-token scales, {ratio.bounded:.3f}" if ratio else "")
        + "); the store allocates rows in capacity classes, so what it holds is up to one class more "
        f"(the dashes at {COST_HISTORY} tokens: allocations measured from /metrics).\n\n" + "\n".join(lines) + "\n"
    )


def policy_tables(data: dict[str, CacheBudget], policies: list[str], multiples: list[str]) -> list[str]:
    """Bits per byte per length, then each retrieval probe, by scheme and cache policy."""
    lines: list[str] = []
    for multiple in multiples:
        lines += [f"### Bits per byte at {multiple}x the training context, by cache policy", "",
                  "| scheme | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]  # fmt: skip
        for scheme, figures in data.items():
            cells = [fmt(figures["bpb"][p].get(multiple)) for p in policies]
            lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
        lines.append("")
    probes = sorted({k for c in data.values() for cells in c["retrieval"].values() for k in cells})
    for probe in probes:
        kind, length = probe.split("@")
        what = f"copy, {length} filler bytes between the copies" if kind == "copy" else f"passkey, {length} bytes"
        lines += [f"### Retrieval under each policy: {what} (95% intervals)", "",
                  "| scheme | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]  # fmt: skip
        for scheme, figures in data.items():
            lines.append(
                f"| {scheme} | " + " | ".join(cell(figures["retrieval"][p].get(probe)) for p in policies) + " |"
            )
        lines.append("")
    return lines


def int8_table(data: dict[str, CacheBudget]) -> list[str]:
    """int8 K/V against the same policy in float32 (empty where no scheme offers int8)."""
    int8_rows = [(s, f["int8"]) for s, f in data.items() if f.get("int8")]
    if not int8_rows:
        return []
    lines = ["### int8 K/V against full precision", "",
             "| scheme | policy | bpb @1x | bpb @4x | bpb change @1x | bpb change @4x (against the same policy "
             "in float32) | copy@32 | copy@512 |", "|---|---|" + "---|" * 6]  # fmt: skip
    for scheme, int8 in int8_rows:
        full = int8.get("full", {})
        for policy, cells in int8.items():
            changes = []
            # Against the same policy in float32 (measured on the same texts in the bpb tables),
            # or the full cache where that policy was not measured at this length.
            fp32 = data[scheme]["bpb"].get(policy.removesuffix("+int8"), {})
            for m in ("1", "4"):
                base, value = fp32.get(m) or bpb_cell(full.get(m)), bpb_cell(cells.get(m))
                changes.append("" if base is None or value is None else f"{(value / base - 1) * 100:+.2f}%")
            if policy == "full":  # its probes are in the retrieval tables
                cells = {**data[scheme]["retrieval"].get("full", {}), **cells}
            lines.append(
                f"| {scheme} | {policy} | {fmt(bpb_cell(cells.get('1')))} | {fmt(bpb_cell(cells.get('4')))} | "
                f"{changes[0]} | {changes[1]} | {cell(probe_cell(cells.get('copy@32')))} | "
                f"{cell(probe_cell(cells.get('copy@512')))} |"
            )
    return [*lines, ""]


def cost_table(data: dict[str, CacheBudget]) -> list[str]:
    cost_policies = list(dict.fromkeys(p for f in data.values() for p in f["cost"]))
    lines = ["### Cost: KV bytes allocated per sequence and inter-token latency at 2048 tokens of history", "",
             "Cells: MB allocated (from /metrics, one stream alone on the server) / ms per token.", "",
             "| scheme | " + " | ".join(cost_policies) + " |", "|---|" + "---|" * len(cost_policies)]  # fmt: skip
    for scheme, figures in data.items():
        cells = []
        for policy in cost_policies:
            cost = figures["cost"].get(policy)
            cells.append(
                "not servable"
                if cost is None
                else f"{cost['kv_physical_bytes'] / 1e6:.2f} / {cost['itl_s'] * 1000:.2f}"
            )
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return lines


def cache_budget_section(results: Results) -> str:
    data = results.cache_budget
    if not data:
        return "Not measured in this run (`--sections cache`).\n"
    runs = [r for r in results.config.get("runs", []) if "cache" in r["sections"]]
    budget = runs[-1]["budget"] if runs else results.config.get("budget", {})
    policies = next(iter(data.values()))["policies"]
    multiples = sorted({m for c in data.values() for cells in c["bpb"].values() for m in cells}, key=float)
    lines = [*policy_tables(data, policies, multiples), *int8_table(data), *cost_table(data)]
    lines += ["", cache_budget_goals(data, multiples), ""]
    trials, windows = budget.get("cache_trials", "?"), budget.get("cache_windows", "?")
    note = (
        "Texts stream through the policy one token at a time past the budget (StreamingLLM's evaluation); "
        f"{windows} held-out texts per bpb cell, {trials} probes per retrieval cell."
    )
    if runs:
        note += f" Measured at commit `{runs[-1]['environment']['commit']}`."
    return note + "\n\n![quality against KV bytes](cache_budget.png)\n\n" + "\n".join(lines)


def cache_budget_goals(data: dict[str, CacheBudget], multiples: list[str]) -> str:
    """The issue's hypotheses, stated and checked against this run's figures, whichever way they come out."""
    longest = multiples[-1]
    out = ["### The hypotheses, checked", ""]
    alibi = data.get("alibi")
    if alibi and "window:256" in alibi["bpb"]:
        full, window = alibi["bpb"]["full"].get(longest), alibi["bpb"]["window:256"].get(longest)
        if full and window:
            change = (window / full - 1) * 100
            verdict = "holds" if abs(change) <= 2 else "fails"
            out.append(f"- ALiBi under window:256 within 2% of its full-cache bpb at {longest}x: {window:.3f} against "
                       f"{full:.3f} ({change:+.2f}%): **{verdict}**.")  # fmt: skip
    rope = data.get("rope")
    if rope:
        full = rope["bpb"]["full"].get(longest)
        for policy in rope["bpb"]:
            if not policy.startswith("window:") or full is None:
                continue
            size = policy_budget(policy)
            sinks = rope["bpb"].get(f"sinks:4+window:{(size or 0) - 4}", {}).get(longest)
            window = rope["bpb"][policy].get(longest)
            if window is None or sinks is None:
                continue
            if window <= full:
                out.append(f"- RoPE, {size}-token budget at {longest}x: window alone {window:.3f}, sinks {sinks:.3f}, "
                           f"full {full:.3f}: the window does not degrade, it is better than the full cache (it keeps "
                           "every distance within the trained ones), and sinks change it by "
                           f"{(sinks / window - 1) * 100:+.1f}%: **fails** (the hypothesis: a window degrades it "
                           "and sinks repair most of that).")  # fmt: skip
                continue
            repaired = (1 - (sinks - full) / (window - full)) * 100
            verdict = "holds" if repaired >= 50 else "fails"
            out.append(f"- RoPE, {size}-token budget at {longest}x: window alone {window:.3f}, sinks {sinks:.3f}, "
                       f"full {full:.3f}; sinks repair {repaired:.0f}% of the window's loss: **{verdict}** "
                       "(the hypothesis: a window degrades it and sinks repair most of that).")  # fmt: skip
    for scheme, figures in data.items():
        int8 = figures.get("int8", {})
        full, quantized = bpb_cell(int8.get("full", {}).get("1")), bpb_cell(int8.get("int8", {}).get("1"))
        if full and quantized:
            change = (quantized / full - 1) * 100
            bytes_int8 = (figures["cost"].get("int8") or {}).get("kv_physical_bytes")
            bytes_full = (figures["cost"].get("full") or {}).get("kv_physical_bytes")
            ratio = f", {bytes_int8 / bytes_full:.2f}x the bytes" if bytes_int8 and bytes_full else ""
            verdict = "holds" if abs(change) <= 1 else "fails"
            out.append(f"- {scheme}: int8 K/V changes bpb at 1x by {change:+.2f}%{ratio}: **{verdict}** (goal: at most "
                       "1% at a quarter of fp32's bytes).")  # fmt: skip
    return "\n".join(out)
