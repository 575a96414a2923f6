"""The report's `reuse` section: the shared prefix with and without the prefix cache, the documents
workload under each way of computing its K/V, and what each scheme's reuse comes to (pure functions
of the results)."""

from __future__ import annotations

import math

from contract.manifest import REUSE_RECOMPUTE
from loadtest.report.formatting import cell, fmt
from loadtest.report.seeds import label
from loadtest.study.results import Cell, Results, Reuse, ReuseMode, SharedPrefix
from loadtest.study.rounds import Spread
from loadtest.workloads import DOCUMENTS, DOCUMENTS_PER_PROMPT, PROMPTS_PER_SET

TTFT_RATIO_GOAL = 0.1  # issue 31: TTFT p50 at one user with the cache over without
GOODPUT_GAIN_GOAL = 3.0  # issue 31: goodput at the most users with the cache over without
REUSE_WITHIN = 0.01  # a document reused "within 1% bpb" of the full recompute
GUESSING_BPB = math.log2(10)  # a uniform guess at each digit of the key
MODE_NAMES = {
    "full": "full recompute",
    "prefix": "exact prefix cache",
    "as_is": "reuse as is",
    "rotate": "reuse, rope re-rotated",
    "sink": "sink-kept precompute (EPIC)",
    "repair:all": "repair, whole document",
}
WHOLE = 1 << 30  # where `repair:all` sorts among the repairs
RECOMPUTES = "cannot: positions enter every layer's input, so the server recomputes each document (`recompute`)"


def mode_name(mode: str) -> str:
    return MODE_NAMES.get(mode) or f"repair k = {mode.split(':')[1]}"


def repair_k(mode: str) -> int:
    """A `repair:K` mode's K (`repair:all`: past every document)."""
    k = mode.split(":")[1]
    return WHOLE if k == "all" else int(k)


def repairs_of(modes: dict[str, ReuseMode | None] | dict[str, Cell | None]) -> list[str]:
    """The repair modes in order of k, the whole document last."""
    return sorted((m for m in modes if m.startswith("repair:")), key=repair_k)


def verdict(change: Cell | None) -> str | None:
    """`within` when the paired interval lies inside +-1%, `cannot` when it lies wholly above +1%,
    `better` when it lies wholly below -1% (the reused answer reads better than the recompute's: no
    loss, though not the recompute's answer), `undecided` otherwise (None: no interval)."""
    if change is None or "low" not in change:
        return None
    if -REUSE_WITHIN <= change["low"] and change["high"] <= REUSE_WITHIN:
        return "within"
    if change["low"] > REUSE_WITHIN:
        return "cannot"
    if change["high"] < -REUSE_WITHIN:
        return "better"
    return "undecided"


def change_text(change: Cell) -> str:
    return f"{change['value']:+.1%} [{change['low']:+.1%}, {change['high']:+.1%}]"


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


def mode_changes(reuse: Reuse, form: str, seed: str | None = None) -> dict[str, Cell | None] | None:
    """Each mode's paired change from the full recompute on one prompt sample (None: not measured)."""
    if seed is not None and seed != str(reuse.get("seed", 32)):
        return reuse.get("samples", {}).get(seed, {}).get(form)
    figures = reuse["documents"].get(form)
    if figures is None or figures["modes"].get("full") is None:
        return None
    return {name: None if mode is None else mode.get("change") for name, mode in figures["modes"].items()}


def finding(reuse: Reuse, form: str, seed: str | None = None) -> str:
    """Whether the scheme reuses a document at any offset within 1% bpb of the full recompute, needs
    the repair or the sink-kept precompute (the smallest k that does), cannot, or is undecided: each
    from the paired 95% interval of the answer's change, never from a point estimate."""
    return judge(reuse, form, seed)[1]


def judge(reuse: Reuse, form: str, seed: str | None = None) -> tuple[str, str]:
    """`finding`'s verdict as (its kind, in a few words; its sentence)."""
    if reuse["segment_reuse"] == REUSE_RECOMPUTE:
        return "recomputes", RECOMPUTES
    figures = reuse["documents"].get(form)
    changes = mode_changes(reuse, form, seed)
    if figures is None or figures["modes"].get("full") is None or changes is None:
        return "not measured", "not measured (the prompts do not fit the model)"
    full = figures["modes"]["full"]["bpb"]  # type: ignore[index]
    if full is not None and full["value"] > GUESSING_BPB:
        return "no baseline", (f"no baseline: the full recompute does not retrieve here (answer {full['value']:.2f} "
                               "bpb, guessing 3.32)")  # fmt: skip
    placement = reuse["segment_reuse"]
    change = changes.get(placement)
    said = verdict(change)
    if change is None or said is None:
        return "not measured", "not measured (no paired interval: a run before issue 48)"
    how = "as is" if placement == "as_is" else "re-rotated"
    n = int(change["n"])
    if said == "within":
        return "within 1%", f"reuses a document at any offset {how}, within 1% ({change_text(change)} bpb)"
    if said == "better":
        return "reads better", (f"reuses a document at any offset {how} and reads better than the full recompute "
                                f"({change_text(change)} bpb)")  # fmt: skip
    fixes = [(mode_name(m), changes[m]) for m in ["sink", *repairs_of(changes)] if m in changes and m != "repair:all"]
    for name, fixed in fixes:
        if verdict(fixed) == "within":
            return f"needs {name}", f"needs {name}: {how} {change_text(change)} bpb, with it {change_text(fixed)}"  # type: ignore[arg-type]
    if said == "undecided":
        return "undecided", f"undecided at {n} prompts: {how} {change_text(change)} bpb"
    if any(verdict(fixed) == "undecided" for _, fixed in fixes):
        return "cannot as placed", (f"cannot as placed ({how} {change_text(change)} bpb); a repair or the sink is "
                                    f"undecided at {n} prompts")  # fmt: skip
    return "cannot", (f"cannot within 1%: {how} {change_text(change)} bpb; no repair short of the whole document, nor "
                      "the sink-kept precompute, brings it within 1%")  # fmt: skip


def scheme_verdict(results: Results, scheme: str) -> str | None:
    """The scheme's reuse verdict on every form, with its paired interval: for the report's Findings
    (None: the run has no reuse figures for the scheme)."""
    reuse = results.reuse.get(scheme)
    if reuse is None:
        return None
    forms = list(reuse["documents"])
    if reuse["segment_reuse"] == REUSE_RECOMPUTE:
        return finding(reuse, forms[0]) if forms else None
    return "; ".join(f"{form} documents: {finding(reuse, form)}" for form in forms)


def clustered(results: Results) -> bool:
    """Whether the run drew a fresh document set every few prompts and resampled the sets (issue 55),
    rather than one set of 8 documents per prompt sample with an interval over prompts."""
    return any(
        "clusters" in (mode.get("change") or {})
        for reuse in results.reuse.values()
        for form in reuse["documents"].values()
        for mode in form["modes"].values()
        if mode is not None
    )


def documents_method(results: Results) -> str:
    """How the documents workload's prompts were drawn, and what their intervals are over."""
    if clustered(results):
        drawn = (f"a fresh set of {DOCUMENTS} documents of held-out text for every {PROMPTS_PER_SET} prompts; each "
                 f"prompt holds {DOCUMENTS_PER_PROMPT} of its set's documents in a random order")  # fmt: skip
        over = "one observation per document set: prompts of a set share documents"
    else:
        drawn = (f"{DOCUMENTS} documents of held-out text per prompt sample; each prompt holds {DOCUMENTS_PER_PROMPT} "
                 "of them in a random order")  # fmt: skip
        over = "one observation per prompt"
    return (
        f"**Documents in varying order** (RAG-like): {drawn}, a fresh 5-digit key planted in one as a line of "
        "code, asked for at the end (the passkey probe's wording). Accuracy: the share of the key's digits the "
        f"server's greedy generation gets (95% Wilson interval, {over}). TTFT: the server's. "
    )


def samples_note(results: Results) -> str:
    """What the paired interval holds, and why the verdict is asked of more than one prompt sample."""
    if clustered(results):
        return (
            "The interval resamples whole document sets (each set's prompts share documents), so it holds the "
            "variation between documents as well as between prompts: a fresh prompt sample's figure should fall "
            "inside it about 4 times in 5 (the two samples' difference has twice one sample's variance). The "
            "verdict is asked of every sample."
        )
    return (
        f"Each prompt sample draws its own {DOCUMENTS} documents, and the interval is over prompts given them: two "
        "samples can differ by more than their intervals (the documents are a second source of variation the "
        "interval does not hold), which is why the verdict is asked of both."
    )


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
            pairs = [("ttft_p50_s", 0, 1000), ("ttft_p99_s", 0, 1000), ("goodput_per_s", 2, 1), ("tokens_per_s", 0, 1),
                     ("refused_per_s", 1, 1)]  # fmt: skip
            figures = " | ".join(
                f"{shown(shared, 'no_cache', users, key, digits, scale)} | "
                f"{shown(shared, 'cache', users, key, digits, scale)}"
                for key, digits, scale in pairs
            )
            rows.append(f"| {scheme} | {shared['prefix_bytes']} + {shared['tail_bytes']} | {users} | {figures} |")
        ttft, gain = prefix_ratios(shared)
        summary.append(f"| {scheme} | {fmt(ttft, 3, missing='-')} | {fmt(gain, 1, missing='-')} |")
    return "\n".join(rows) + "\n\n" + "\n".join(summary) + "\n"


def shown(shared: SharedPrefix, side: str, users: str, key: str, digits: int, scale: float) -> str:
    """One shared-prefix figure: its rounds' `median [min-max]`, or the one figure of older runs."""
    values = [figures[key] for figures in shared.get("rounds", {}).get(side, {}).get(users, [])]
    if len(values) > 1:
        return Spread.of(values).text(digits, scale)
    return fmt(shared[side].get(users, {}).get(key), digits, scale, "-")  # type: ignore[literal-required]


def documents_table(results: Results, form: str) -> str:
    rows = [
        "| scheme | mode | accuracy (served, greedy) | answer bpb | bpb vs full, paired 95% | "
        "accuracy (teacher-forced) | TTFT ms p50 | prompt cached | prompt reused |",
        "|" + "---|" * 9,
    ]
    for scheme in results.schemes:
        reuse = results.reuse.get(scheme)
        figures = None if reuse is None else reuse["documents"].get(form)
        if reuse is None or figures is None:
            continue
        modes = figures["modes"]
        order = ["full", "prefix", "as_is", "rotate", "sink", *repairs_of(modes)]
        for name in (m for m in order if m in modes):
            mode = modes[name]
            if mode is None:
                rows.append(f"| {scheme} | {mode_name(name)} | not servable | | | | | | |")
                continue
            paired = mode.get("change")
            if paired is not None and name != "full":
                change = change_text(paired)
            else:
                point = bpb_change(mode, modes.get("full"))
                change = "-" if point is None else f"{point:+.1%}"
            served = mode["ttft_s"] is not None
            rows.append(
                f"| {scheme} | {mode_name(name)} | {cell(mode['accuracy']) if served else 'not served'} | "
                f"{cell(mode['bpb'], 3) if mode['bpb'] else '-'} | {change} | "
                f"{cell(mode['teacher_forced']) if mode['teacher_forced'] else '-'} | "
                f"{fmt(mode['ttft_s'], 1, 1000, '-')} | {fmt(mode['cached_share'], 2, missing='-')} | "
                f"{fmt(mode['reused_share'], 2, missing='-')} |"
            )
        if reuse["segment_reuse"] == REUSE_RECOMPUTE:
            rows.append(f"| {scheme} | reuse, repairs | `recompute` (ListModels): nothing reused | | | | | | |")
    return "\n".join(rows) + "\n"


def served_reuse(results: Results) -> dict[str, Reuse]:
    """The served models' reuse figures by scheme (a further training seed's are under its own name)."""
    return {scheme: results.reuse[scheme] for scheme in results.schemes if scheme in results.reuse}


def seeds_of(reuse: Reuse) -> list[str]:
    """The prompt samples a scheme was scored on, the served one first."""
    return [str(reuse.get("seed", 32)), *reuse.get("samples", {})]


def repair_curve_table(results: Results, form: str) -> str:
    """Per scheme and prompt sample: the change from the full recompute as placed (k = 0), at each
    repair's k, with the whole document repaired, and with the sink-kept precompute."""
    reusing = {s: r for s, r in served_reuse(results).items() if r["segment_reuse"] != REUSE_RECOMPUTE}
    columns: list[str] = []
    for reuse in reusing.values():
        for seed in seeds_of(reuse):
            for mode in repairs_of(mode_changes(reuse, form, seed) or {}):
                columns += [mode] if mode not in columns else []
    columns.sort(key=repair_k)
    if not columns:
        return ""
    names = ["k = 0 (as placed)", *(("whole document" if m == "repair:all" else f"k = {repair_k(m)}") for m in columns),
             "sink-kept precompute"]  # fmt: skip
    rows = ["| scheme | prompt seed | " + " | ".join(names) + " |", "|" + "---|" * (2 + len(names))]
    for scheme, reuse in reusing.items():
        for seed in seeds_of(reuse):
            changes = mode_changes(reuse, form, seed)
            if changes is None:
                continue
            row = [changes.get(m) for m in [reuse["segment_reuse"], *columns, "sink"]]
            figures = " | ".join("-" if c is None else change_text(c) for c in row)
            rows.append(f"| {scheme} | {seed} | {figures} |")
    return "\n".join(rows) + "\n"


def contradictions(reuse: Reuse, form: str) -> tuple[list[str], list[str]]:
    """Modes whose verdicts contradict across prompt samples (`within` or `better` on one, `cannot` on
    another),
    and modes undecided on some sample."""
    found = [changes for seed in seeds_of(reuse) if (changes := mode_changes(reuse, form, seed)) is not None]
    clash, open_ = [], []
    measured = {m for changes in found for m in changes} - {"full", "prefix"}
    for mode in sorted(measured, key=lambda m: (m.startswith("repair:"), repair_k(m) if ":" in m else 0, m)):
        said = {verdict(changes.get(mode)) for changes in found} - {None}
        if "cannot" in said and said & {"within", "better"}:
            clash.append(mode)
        elif "undecided" in said:
            open_.append(mode)
    return clash, open_


def samples_table(results: Results, forms: list[str]) -> str:
    """Each scheme's verdict on every prompt sample, and whether the samples agree."""
    seeds = list(dict.fromkeys(seed for r in served_reuse(results).values() for seed in seeds_of(r)))
    rows = ["| scheme | form | " + " | ".join(f"prompt seed {s}" for s in seeds) + " | samples agree? |",
            "|" + "---|" * (3 + len(seeds))]  # fmt: skip
    for scheme, reuse in served_reuse(results).items():
        if reuse["segment_reuse"] == REUSE_RECOMPUTE:
            continue
        for form in forms:
            said = [finding(reuse, form, seed) for seed in seeds]
            clash, open_ = contradictions(reuse, form)
            undecided = f" (undecided: {', '.join(mode_name(m) for m in open_)})" if open_ else ""
            clashing = ", ".join(mode_name(m) for m in clash)
            agree = f"**no**: {clashing} no loss on one, cannot on another" if clash else "yes" + undecided
            rows.append(f"| {scheme} | {form} | " + " | ".join(said) + f" | {agree} |")
    return "\n".join(rows) + "\n"


def training_seeds_table(results: Results, forms: list[str]) -> str:
    """Per scheme with several training seeds and form: each seed's change as the scheme places documents
    and its verdict, on the served prompt sample, and whether the seeds agree (empty: no such scheme)."""
    rows = ["| scheme | form | training seed: change as placed, verdict | seeds agree? |", "|---|---|---|---|"]
    for scheme in results.schemes:
        models = {seed: model for seed, model in results.seeded(scheme, results.reuse).items() if seed is not None}
        if len(models) < 2 or results.reuse[scheme]["segment_reuse"] == REUSE_RECOMPUTE:
            continue
        for form in forms:
            judged = {seed: judge(results.reuse[model], form) for seed, model in models.items()}
            placement = results.reuse[scheme]["segment_reuse"]
            changes = {seed: (mode_changes(results.reuse[model], form) or {}).get(placement)
                       for seed, model in models.items()}  # fmt: skip
            cells = "; ".join(f"{seed}: {'-' if changes[seed] is None else change_text(changes[seed])} {kind}"  # type: ignore[arg-type]
                              for seed, (kind, _) in judged.items())  # fmt: skip
            kinds = {kind for kind, _ in judged.values()}
            agree = "yes" if len(kinds) == 1 else "**no**: " + ", ".join(sorted(kinds))
            rows.append(f"| {scheme} | {form} | {cells} | {agree} |")
    return "" if len(rows) == 2 else "\n".join(rows) + "\n"


def reuse_section(results: Results) -> str:
    """The whole section, ending in a blank line (empty when the run has no reuse figures)."""
    if not served_reuse(results):
        return ""
    some = next(iter(served_reuse(results).values()))
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
        documents_method(results)
        + "The answer's bits per byte are computed in-process through the engine's own prompt assembly "
        "(loadtest/study/reuse_scoring.py): the service returns no log-probabilities from `Generate`. "
        "`reuse as is` for rope is that in-process figure only: the server always re-rotates rope's keys. "
        "The exact prefix cache's K/V is a fresh prefill's, so its bpb is the full recompute's.\n",
    ]
    for form in forms:
        parts.append(f"### {form.capitalize()} form: documents of about {document_bytes[form]} bytes, "
                     f"{trials[form]} prompts\n")  # fmt: skip
        parts.append(documents_table(results, form))
    curves = {form: repair_curve_table(results, form) for form in forms}
    if any(curves.values()):
        parts.append("### The repair curve and EPIC's sink-kept precompute\n")
        parts.append(
            "The answer's bits per byte against the full recompute of the same prompts (paired 95% bootstrap "
            f"interval over {'document sets' if clustered(results) else 'prompts'}, in-process), on every prompt "
            "sample: the documents as the scheme places them "
            "(k = 0), the first k tokens of each document recomputed in context, every token of it recomputed "
            "(which must read +0.0%: a check, not a mode worth serving), and EPIC's precompute, each document "
            "computed after a BOS of its own (a sink) that is dropped when the document is placed. Why more "
            "repair can read worse until the whole document is repaired: a repair recomputes each document's first "
            "k tokens in context, but the rest of the document keeps K/V that were computed attending to the "
            "isolated versions of those tokens, so the repaired head and the stale tail no longer agree, and the "
            "mismatch grows with k until no stale token is left. Computed alone, a document's first token is "
            "its own attention sink (the BOS's role): where the sink-kept precompute removes most of a scheme's "
            "cost, that false sink placed in the middle of the prompt is what the cost was.\n"
        )
        for form in forms:
            if curves[form]:
                parts.append(f"**{form.capitalize()} form**\n")
                parts.append(curves[form])
        parts.append("![repair curve](reuse_repair.png)\n")
    parts.append("### What reuse buys each scheme (the answer's bpb within 1% of the full recompute)\n")
    parts.append(
        'Each verdict comes from the paired 95% interval of the change from the full recompute: "within 1%" '
        'only when the interval lies inside +-1%, "cannot" only when it lies wholly above +1%, "reads better" '
        'when it lies wholly below -1% (no loss, though not the recompute\'s answer), otherwise "undecided" at '
        'that many prompts. ' + samples_note(results) + " Every prompt sample's verdict, and "
        "whether they agree:\n"
    )
    parts.append(samples_table(results, forms))
    seeded = training_seeds_table(results, forms)
    if seeded:
        parts.append(
            "Every training seed of a scheme, on the served prompt sample (each seed's own paired interval; a "
            "further seed is scored in-process only), and whether the seeds' verdicts agree:\n"
        )
        parts.append(seeded)
    header = "| scheme | declared (ListModels) | " + " | ".join(f"{form} form" for form in forms) + " |"
    lines = [header, "|" + "---|" * (2 + len(forms))]
    for scheme, reuse in served_reuse(results).items():
        found = " | ".join(finding(reuse, form) for form in forms)
        lines.append(f"| {label(results, scheme)} | `{reuse['segment_reuse']}` | {found} |")
    parts.append("\n".join(lines) + "\n")
    return "\n".join(parts) + "\n"
