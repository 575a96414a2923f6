"""The report's `reuse` section: the shared prefix with and without the prefix cache, the documents
workload under each way of computing its K/V, and what each scheme's reuse comes to (pure functions
of the results)."""

from __future__ import annotations

import math

from contract.manifest import REUSE_RECOMPUTE
from loadtest.report.formatting import cell, fmt
from loadtest.study.results import Results, Reuse, ReuseMode, SharedPrefix

TTFT_RATIO_GOAL = 0.1  # issue 31: TTFT p50 at one user with the cache over without
GOODPUT_GAIN_GOAL = 3.0  # issue 31: goodput at the most users with the cache over without
REUSE_WITHIN = 0.01  # a document reused "within 1% bpb" of the full recompute
GUESSING_BPB = math.log2(10)  # a uniform guess at each digit of the key
MODE_NAMES = {
    "full": "full recompute",
    "prefix": "exact prefix cache",
    "as_is": "reuse as is",
    "rotate": "reuse, rope re-rotated",
}


def mode_name(mode: str) -> str:
    return MODE_NAMES.get(mode) or f"repair k = {mode.split(':')[1]}"


def prefix_ratios(shared: SharedPrefix) -> tuple[float | None, float | None]:
    """TTFT p50 with the cache over without at the fewest users; goodput with over without at the most."""
    users = sorted(set(shared["cache"]) & set(shared["no_cache"]), key=int)
    if not users:
        return None, None
    fewest, most = shared["cache"][users[0]], shared["no_cache"][users[0]]
    ttft = fewest["ttft_p50_s"] / most["ttft_p50_s"] if most["ttft_p50_s"] else None
    on, off = shared["cache"][users[-1]]["goodput_per_s"], shared["no_cache"][users[-1]]["goodput_per_s"]
    gain = on / off if off else (float("inf") if on else None)
    return ttft, gain


def bpb_change(mode: ReuseMode | None, full: ReuseMode | None) -> float | None:
    """The answer's bits per byte under `mode` over the full recompute's, less one."""
    if not mode or not full or not mode["bpb"] or not full["bpb"] or not full["bpb"]["value"]:
        return None
    return mode["bpb"]["value"] / full["bpb"]["value"] - 1


def finding(reuse: Reuse, form: str) -> str:
    """Whether the scheme reuses a document at any offset within 1% bpb of the full recompute, needs
    the repair (the smallest k that does), or cannot."""
    if reuse["segment_reuse"] == REUSE_RECOMPUTE:
        return "cannot: positions enter every layer's input, so the server recomputes each document (`recompute`)"
    figures = reuse["documents"].get(form)
    if figures is None or figures["modes"].get("full") is None:
        return "not measured (the prompts do not fit the model)"
    modes, placement = figures["modes"], reuse["segment_reuse"]
    full = modes["full"]["bpb"]
    if full is not None and full["value"] > GUESSING_BPB:
        return f"no baseline: the full recompute does not retrieve here (answer {full['value']:.2f} bpb, guessing 3.32)"
    change = bpb_change(modes.get(placement), modes["full"])
    if change is None:
        return "not measured"
    how = "as is" if placement == "as_is" else "re-rotated"
    if change <= REUSE_WITHIN:
        return f"reuses a document at any offset {how}, within 1% ({change:+.1%} bpb)"
    repairs = sorted((int(m.split(":")[1]), m) for m in modes if m.startswith("repair:"))
    for k, name in repairs:
        repaired = bpb_change(modes[name], modes["full"])
        if repaired is not None and repaired <= REUSE_WITHIN:
            return f"needs the repair: {how} {change:+.1%} bpb, with k = {k} {repaired:+.1%}"
    worst = bpb_change(modes[repairs[-1][1]], modes["full"]) if repairs else None
    tail = f", k = {repairs[-1][0]} still {worst:+.1%}" if worst is not None else ""
    return f"cannot within 1%: {how} {change:+.1%} bpb{tail}"


def shared_prefix_table(results: Results) -> str:
    rows = [
        "| scheme | prefix + tail bytes | users | TTFT p50 ms, no cache | with cache | TTFT p99 ms, no cache | "
        "with cache | goodput req/s, no cache | with cache | tokens/s, no cache | with cache | refused/s, no cache "
        "| with cache |",
        "|" + "---|" * 13,
    ]
    summary = [
        f"| scheme | TTFT p50 with / without @ fewest users (goal <= {TTFT_RATIO_GOAL:g}) | goodput with / without "
        f"@ most users (goal >= {GOODPUT_GAIN_GOAL:g}) |",
        "|---|---|---|",
    ]
    for scheme in results.schemes:
        reuse = results.reuse.get(scheme)
        if reuse is None:
            continue
        shared = reuse["shared_prefix"]
        for users in sorted(shared["cache"], key=int):
            off, on = shared["no_cache"].get(users, {}), shared["cache"][users]
            pairs = [("ttft_p50_s", 0, 1000), ("ttft_p99_s", 0, 1000), ("goodput_per_s", 2, 1), ("tokens_per_s", 0, 1),
                     ("refused_per_s", 1, 1)]  # fmt: skip
            figures = " | ".join(
                f"{fmt(off.get(key), digits, scale, '-')} | {fmt(on.get(key), digits, scale, '-')}"
                for key, digits, scale in pairs
            )
            rows.append(f"| {scheme} | {shared['prefix_bytes']} + {shared['tail_bytes']} | {users} | {figures} |")
        ttft, gain = prefix_ratios(shared)
        summary.append(f"| {scheme} | {fmt(ttft, 3, missing='-')} | {fmt(gain, 1, missing='-')} |")
    return "\n".join(rows) + "\n\n" + "\n".join(summary) + "\n"


def documents_table(results: Results, form: str) -> str:
    rows = [
        "| scheme | mode | accuracy (served, greedy) | answer bpb | bpb vs full | accuracy (teacher-forced) | "
        "TTFT ms p50 | prompt cached | prompt reused |",
        "|" + "---|" * 9,
    ]
    for scheme in results.schemes:
        reuse = results.reuse.get(scheme)
        figures = None if reuse is None else reuse["documents"].get(form)
        if reuse is None or figures is None:
            continue
        modes = figures["modes"]
        order = ["full", "prefix", "as_is", "rotate", *sorted((m for m in modes if m.startswith("repair:")),
                                                              key=lambda m: int(m.split(":")[1]))]  # fmt: skip
        for name in (m for m in order if m in modes):
            mode = modes[name]
            if mode is None:
                rows.append(f"| {scheme} | {mode_name(name)} | not servable | | | | | | |")
                continue
            change = bpb_change(mode, modes.get("full"))
            served = mode["ttft_s"] is not None
            rows.append(
                f"| {scheme} | {mode_name(name)} | {cell(mode['accuracy']) if served else 'not served'} | "
                f"{cell(mode['bpb'], 3) if mode['bpb'] else '-'} | {'-' if change is None else f'{change:+.1%}'} | "
                f"{cell(mode['teacher_forced']) if mode['teacher_forced'] else '-'} | "
                f"{fmt(mode['ttft_s'], 1, 1000, '-')} | {fmt(mode['cached_share'], 2, missing='-')} | "
                f"{fmt(mode['reused_share'], 2, missing='-')} |"
            )
        if reuse["segment_reuse"] == REUSE_RECOMPUTE:
            rows.append(f"| {scheme} | reuse, repairs | `recompute` (ListModels): nothing reused | | | | | | |")
    return "\n".join(rows) + "\n"


def reuse_section(results: Results) -> str:
    """The whole section, ending in a blank line (empty when the run has no reuse figures)."""
    if not results.reuse:
        return ""
    some = next(iter(results.reuse.values()))
    forms = list(some["documents"])
    trials = {form: some["documents"][form]["trials"] for form in forms}
    document_bytes = {form: some["documents"][form]["document_bytes"] for form in forms}
    slo = results.config.get("admission_ttft_slo_s")
    parts = [
        "## KV reuse: a shared prefix, and documents in varying order\n",
        "**Shared prefix**: closed-loop users streaming 32 new tokens (sampling) after one long prefix every "
        "request shares and a unique tail of held-out text (scaled down together for a model with fewer "
        f"positions), against servers with admission control (`--ttft-slo-seconds {slo}`), one set started with "
        "`--no-prefix-cache`, one with the prefix cache, both running at once: each level measures a scheme "
        "without and with the cache back to back (from f6cfe9a on; earlier runs measured one set after the "
        "other). Goodput and TTFT as in the load section (TTFT measured by the client).\n",
        "![reuse](reuse.png)\n",
        shared_prefix_table(results),
        "**Documents in varying order** (RAG-like): 8 documents of held-out text; each prompt holds 4 of them in "
        "a random order, a fresh 5-digit key planted in one as a line of code, asked for at the end "
        "(the passkey probe's wording). Accuracy: the share of the key's digits the server's greedy "
        "generation gets (95% Wilson interval, one observation per prompt). TTFT: the server's. The "
        "answer's bits per byte are computed in-process through the engine's own prompt assembly "
        "(loadtest/study/reuse_scoring.py): the service returns no log-probabilities from `Generate`. "
        "`reuse as is` for rope is that in-process figure only: the server always re-rotates rope's keys. "
        "The exact prefix cache's K/V is a fresh prefill's, so its bpb is the full recompute's.\n",
    ]
    for form in forms:
        parts.append(f"### {form.capitalize()} form: documents of about {document_bytes[form]} bytes, "
                     f"{trials[form]} prompts\n")  # fmt: skip
        parts.append(documents_table(results, form))
    parts.append("### What reuse buys each scheme (the answer's bpb within 1% of the full recompute)\n")
    header = "| scheme | declared (ListModels) | " + " | ".join(f"{form} form" for form in forms) + " |"
    lines = [header, "|" + "---|" * (2 + len(forms))]
    for scheme in results.schemes:
        reuse = results.reuse.get(scheme)
        if reuse is not None:
            found = " | ".join(finding(reuse, form) for form in forms)
            lines.append(f"| {scheme} | `{reuse['segment_reuse']}` | {found} |")
    parts.append("\n".join(lines) + "\n")
    return "\n".join(parts) + "\n"
