"""The report's markdown tables for quality, latency, load, goodput, memory, retrieval, what each
scheme buys, and training."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loadtest.report.analysis import (
    GOODPUT_RATIO_GOAL,
    REFUSALS_PER_GOOD_GOAL,
    bpb_cell,
    chance_fraction,
    goodput_ratio,
    largest,
    load_spreads,
    pooled,
    refusals_per_good,
    verdict,
)
from loadtest.report.formatting import cell, fmt, kv_bytes
from loadtest.report.seeds import agreement, label
from loadtest.study.results import ByLength, Probe, Results, TrainingCurve
from loadtest.study.rounds import Spread, goodput_ratio_rounds
from models import emergence


def grid_table(
    title: str,
    data: dict[str, ByLength],
    scale: float,
    digits: int,
    rounds: dict[str, dict[str, list[float]]] | None = None,
) -> str:
    """One row per scheme, one column per length; with `rounds` (each cell's values, a round each),
    a cell measured more than once reads `median [min-max]`."""
    keys = sorted({k for v in data.values() for k in v}, key=float)
    lines = [f"### {title}", "", "| scheme | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for scheme, row in data.items():
        values = (rounds or {}).get(scheme, {})
        cells = [
            Spread.of(values[k]).text(digits, scale) if values.get(k) and row.get(k) is not None
            else fmt(row.get(k), digits, scale)
            for k in keys
        ]  # fmt: skip
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def headline_table(results: Results) -> str:
    multiples = sorted({m for s in results.schemes for m in results.quality.get(s, {})}, key=float)
    users = sorted({u for s in results.schemes for u in results.load.get(s, {})}, key=int)
    top = users[-1] if users else None
    itl_ctx = max((int(c) for s in results.schemes for c in results.itl.get(s, {})), default=0)
    header = ["scheme", *[f"bpb@{m}x" for m in multiples], f"ITL ms @{itl_ctx}"]
    if top:
        header += [f"p99 s @{top} users", f"tokens/s @{top}", f"goodput req/s @{top}, no admission"]
    header += ["KV B/token", "copy @<=128 B", "copy @8x", "passkey @8x"]
    cache = results.cache_budget
    if cache:  # what a bounded or int8 cache keeps: bpb at the longest text under window:256, int8 at 1x
        header += ["bpb@8x window:256", "bpb@8x sinks:4+window:252", "int8 bpb change @1x"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for scheme in results.schemes:
        quality = results.quality.get(scheme, {})
        load = results.load.get(scheme, {}).get(top, {}) if top else {}
        cells = [
            scheme,
            *[fmt(quality.get(m)) for m in multiples],
            fmt(results.itl.get(scheme, {}).get(str(itl_ctx)), 2, 1000),
        ]
        if top:
            cells += [fmt(load.get("p99_s"), 2), fmt(load.get("tokens_per_s"), 0), fmt(load.get("goodput_per_s"), 2)]
        info = results.models.get(scheme)
        copy = results.probe(scheme, "copy")
        cells += [
            "" if info is None else kv_bytes(info),
            cell(pooled(copy, 128)),
            cell(largest(copy)),
            cell(largest(results.probe(scheme, "passkey"))),
        ]
        if cache:
            figures = cache.get(scheme)
            bpb = {} if figures is None else figures["bpb"]
            int8 = {} if figures is None else figures.get("int8", {})
            longest = max((m for cells_ in bpb.values() for m in cells_), key=float, default="8")
            full, quantized = bpb_cell(int8.get("full", {}).get("1")), bpb_cell(int8.get("int8", {}).get("1"))
            change = f"{(quantized / full - 1) * 100:+.2f}%" if full and quantized else "not measured"
            cells += [
                fmt(bpb[policy].get(longest)) if policy in bpb else "not measured"
                for policy in ("window:256", "sinks:4+window:252")
            ]
            cells.append(change)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_table(results: Results) -> str:
    rows = ["| scheme | users | requests | errors | p50 s | p95 s | p99 s | TTFT p50 ms | ITL p50 ms | tokens/s "
            "| goodput req/s | KV peak MB | pool use |", "|" + "---|" * 13]  # fmt: skip
    for scheme, by_users in results.load.items():
        for users, f in sorted(by_users.items(), key=lambda kv: int(kv[0])):
            goodput = load_spreads(results, "load", users, "goodput_per_s").get(scheme)
            rows.append(
                f"| {scheme} | {users} | {f['requests']:.0f} | {f['errors']:.0f} | {f['p50_s']:.3f} | "
                f"{f['p95_s']:.3f} | "
                f"{f['p99_s']:.3f} | {f['ttft_p50_s'] * 1000:.1f} | {f['itl_p50_s'] * 1000:.2f} | "
                f"{f['tokens_per_s']:.0f} | {fmt(f['goodput_per_s'], 2) if goodput is None else goodput.text()} | "
                f"{f['kv_peak_bytes'] / 1e6:.2f} | {f['pool_utilisation'] * 100:.2f}% |"
            )
    return "\n".join(rows)


def rounds_note(results: Results) -> str:
    """How many rounds stand behind the load figures, and how to read them."""
    rounds = results.load_rounds.get("load", {})
    counts = {len(figures) for by_users in rounds.values() for figures in by_users.values()}
    if not counts or max(counts) < 2:
        return (
            "One sample per level: two schemes' figures closer than about a quarter may be the shared "
            "machine's drift, not the schemes."
        )
    return (
        f"Each level was measured in {min(counts)} rounds, every scheme once a round in an order rotated by "
        "level and round; a cell is the rounds' median (goodput: `median [min-max]`). A finding that "
        "compares schemes calls them within noise where their rounds' ranges overlap."
    )


def memory_table(results: Results) -> str:
    rows = ["| scheme | KV B/token | KV peak MB | server peak MB under load (both processes) | "
            "input embedding B/step | attention bias B/step | rotary B/step |", "|" + "---|" * 7]  # fmt: skip
    for scheme, m in results.memory.items():
        rows.append(
            f"| {scheme} | {kv_bytes(results.models[scheme])} | {m['kv_peak_bytes'] / 1e6:.2f} | "
            f"{m['process_peak_bytes'] / 1e6:.0f} | {m['input_embedding_bytes']} | {m['attention_bias_bytes']} | "
            f"{m['rotary_bytes']} |"
        )
    return "\n".join(rows)


def footprint_table(results: Results) -> str:
    """What the served KV store allocates (loadtest/study/kv_footprint.py): bytes per token at each
    sequence length, and the 4 KB requests one fixed budget holds at once, each against rope's."""
    footprint = results.kv_footprint
    if not footprint:
        return ""
    lengths = sorted({k.split("@")[1] for f in footprint.values() for k in f if k.startswith("kv_bytes")}, key=int)
    budget = next((f["fixed_budget_bytes"] for f in footprint.values() if "fixed_budget_bytes" in f), None)
    header = [*(f"K/V B/token @{n}" for n in lengths), f"4 KB requests in {fmt_mb(budget)} MB"]
    rows = ["| scheme | " + " | ".join(header) + " |", "|" + "---|" * (len(header) + 1)]
    rope = footprint.get("rope", {})
    for scheme in [s for s in results.schemes if s in footprint]:
        figures = footprint[scheme]
        cells = [_against(figures.get(f"kv_bytes_per_token@{n}"), rope.get(f"kv_bytes_per_token@{n}"), 0)
                 for n in lengths]  # fmt: skip
        cells.append(_against(figures.get("requests_4kb@budget"), rope.get("requests_4kb@budget"), 0))
        rows.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return (
        "What the served KV store allocates for one sequence (its arrays' bytes, rows rounded up to their "
        "capacity class), and how many sequences of 4,096 tokens (a 4 KB prompt and its answer) one fixed "
        "budget admits at once; rope's ratio beside each. Measured in-process on the server's own runner "
        "(loadtest/study/kv_footprint.py).\n\n" + "\n".join(rows) + "\n"
    )


def budget_load_table(results: Results) -> str:
    """The load under one fixed KV budget with 4 KB prompts (timed.measure_budget_load)."""
    found = results.load_budget
    if not found:
        return ""
    first = next(iter(found.values()))
    rows = ["| scheme | most running at once | goodput req/s | tokens/s | TTFT p50 ms | refused/s | KV peak MB |",
            "|" + "---|" * 7]  # fmt: skip
    for scheme in [s for s in results.schemes if s in found]:
        f = found[scheme]
        rows.append(
            f"| {scheme} | {f.get('running_peak', 0):.0f} | {f['goodput_per_s']:.2f} | {f['tokens_per_s']:.0f} | "
            f"{f['ttft_p50_s'] * 1000:.0f} | {f['refused_per_s']:.2f} | {f['kv_peak_bytes'] / 1e6:.1f} |"
        )
    return (
        f"### One KV budget, 4 KB prompts\n\n{first['users']:.0f} users send {first['prompt_bytes']:.0f}-byte prompts "
        f"to servers whose `--kv-cache-bytes` is {fmt_mb(first['kv_budget_bytes'])} MB (8 rope sequences of "
        "4,096 tokens): a scheme that holds fewer K/V bytes a token runs more of them at once. Whether that "
        "shows as goodput depends on what prefill costs on this machine; either way it is a finding.\n\n"
        + "\n".join(rows) + "\n"
    )


def fmt_mb(value: float | None) -> str:
    return "?" if value is None else f"{value / 2**20:.0f}"


def _against(value: float | None, rope: float | None, digits: int) -> str:
    if value is None:
        return "not servable"
    text = f"{value:,.{digits}f}"
    return text if not rope else f"{text} ({value / rope:.2f}x)"


def goodput_section(results: Results) -> str:
    """Goodput with and without admission control, and the ratio the issue set as its goal: goodput
    at the most users over the best goodput at any fewer users."""
    admission = results.load_admission
    if not admission:
        return "No admission-control series in this run.\n"
    rows = ["| scheme | users | goodput req/s | with admission | refused/s with admission | TTFT p50 ms | "
            "with admission |", "|" + "---|" * 7]  # fmt: skip
    top = max((u for load in admission.values() for u in load), key=int, default="?")
    ratios = [f"| scheme | goodput ratio without admission | with admission (goal >= {GOODPUT_RATIO_GOAL:g}) | "
              f"with admission, each round's | goodput req/s @{top} | refused/s @{top} | refusals per good "
              f"request @{top} (goal <= {REFUSALS_PER_GOOD_GOAL:g}) |", "|" + "---|" * 7]  # fmt: skip
    short = []
    for scheme in results.schemes:
        plain, shed = results.load.get(scheme, {}), admission.get(scheme, {})
        users = sorted(set(plain) | set(shed), key=int)
        for u in users:
            a, b = plain.get(u, {}), shed.get(u, {})
            rows.append(
                f"| {scheme} | {u} | {goodput_text(results, 'load', scheme, u, a)} | "
                f"{goodput_text(results, 'load_admission', scheme, u, b)} | "
                f"{fmt(b.get('refused_per_s'), 1, missing='-')} | "
                f"{fmt(a.get('ttft_p50_s'), 0, 1000, '-')} | {fmt(b.get('ttft_p50_s'), 0, 1000, '-')} |"
            )
        last = shed.get(top, {})
        ratio, spread = goodput_ratio_rounds(results.load_rounds.get("load_admission", {}).get(scheme, {}))
        ratio = goodput_ratio(shed) if ratio is None else ratio
        in_rounds = "-" if spread is None or spread.rounds < 2 else f"{spread.low:.2f}-{spread.high:.2f}"
        ratios.append(f"| {scheme} | {fmt(goodput_ratio(plain), 2, missing='-')} | "
                      f"{fmt(ratio, 2, missing='-')} | {in_rounds} | "
                      f"{fmt(last.get('goodput_per_s'), 2, missing='-')} | "
                      f"{fmt(last.get('refused_per_s'), 1, missing='-')} | "
                      f"{fmt(refusals_per_good(last), 2, missing='-')} |")  # fmt: skip
        if ratio is not None and ratio < GOODPUT_RATIO_GOAL:
            short.append(f"{scheme} by {GOODPUT_RATIO_GOAL - ratio:.2f} (rounds {in_rounds})")
    slo = results.config.get("admission_ttft_slo_s")
    return (
        f"The same closed-loop load against a server started with `--ttft-slo-seconds {slo}`: a request\n"
        "estimated to miss it is refused at once (RESOURCE_EXHAUSTED, `retry-after-ms` hint: when it\n"
        "would meet the target, behind the requests refused before it; the load clients wait as asked),\n"
        "so the requests it admits stay within the goodput targets.\n\n"
        "![goodput](goodput_vs_users.png)\n\n" + "\n".join(rows) + "\n\n"
        "Goodput at the most users over the best goodput at fewer users (1.0: no collapse), and refusals\n"
        "per good request there (each refusal is a round trip of the CPU the admitted requests need); the\n"
        "ratios are of the rounds' medians, each round's own ratio beside them:\n\n"
        + "\n".join(ratios)
        + "\n"
        + (f"\nShort of the {GOODPUT_RATIO_GOAL:g} goal with admission: {'; '.join(short)}.\n" if short else "")
    )


def goodput_text(results: Results, series: str, scheme: str, users: str, figures: dict[str, float]) -> str:
    """A level's goodput: the rounds' `median [min-max]`, or the one figure (\"-\": not measured)."""
    spread = load_spreads(results, series, users, "goodput_per_s").get(scheme)
    return fmt(figures.get("goodput_per_s"), 2, missing="-") if spread is None else spread.text()


def every_seed(results: Results, section: Mapping[str, Any]) -> list[str]:
    """Every model of every scheme that `section` has figures for: each scheme's served model, then its
    further training seeds (`rope@seed2`)."""
    return [model for scheme in results.schemes for model in results.seeded(scheme, section).values()]


def probe_table(title: str, results: Results, probe: Probe, column: str) -> str:
    data = {m: results.probe(m, probe) for m in every_seed(results, results.retrieval) or results.schemes}
    keys = sorted({k for v in data.values() for k in v if k != "all"}, key=int)
    extra = ["all"] if any("all" in v for v in data.values()) else []
    lines = [f"### {title}", "", f"| scheme \\ {column} | " + " | ".join(keys + extra) + " |",
             "|---|" + "---|" * (len(keys) + len(extra))]  # fmt: skip
    digits = 3 if probe == "natural" else 2
    for scheme, row in data.items():
        lines.append(f"| {scheme} | " + " | ".join(cell(row.get(k), digits) for k in keys + extra) + " |")
    return "\n".join(lines) + "\n"


def depth_table(results: Results) -> str:
    grids = {m: results.copy_depth(m) for m in every_seed(results, results.retrieval) or results.schemes}
    depths = sorted({d for grid in grids.values() for row in grid.values() for d in row}, key=float)
    lines = ["### Copy accuracy by context length and depth of the first copy", "",
             "| scheme | context bytes | " + " | ".join(f"depth {d}" for d in depths) + " |",
             "|---|---|" + "---|" * len(depths)]  # fmt: skip
    for scheme, grid in grids.items():
        for context in sorted(grid, key=int):
            cells = " | ".join(cell(grid[context].get(d)) for d in depths)
            lines.append(f"| {scheme} | {context} | {cells} |")
    return "\n".join(lines) + "\n"


def what_each_scheme_buys(results: Results) -> str:
    """Extrapolation (bits per byte past the training context) beside retrieval, per scheme and training
    seed, and where the two disagree. The verdicts are rules over the measured figures, stated below;
    a scheme with several seeds gets a line on whether its seeds' verdicts agree."""
    lines = ["| model | bpb @1x | bpb @longest servable | copy @<=128 B | copy @longest | passkey @longest "
             "| repeated-n-gram bpb, farthest bucket | verdict |", "|" + "---|" * 8]  # fmt: skip
    across: list[str] = []
    for scheme in results.schemes:
        models = results.seeded(scheme, results.retrieval) or {None: scheme}
        said = {str(seed): buys_row(results, model, lines) for seed, model in models.items()}
        if len(said) > 1:
            across.append(f"- {scheme}: {agreement(said)}")
    chance = chance_fraction(results.span_chance)
    return (
        "\n".join(lines)
        + (
            "\n\nRules: *extrapolates* when bits per byte at the longest servable multiple stay within 15% of "
            f"1x; *copies* when the lower end of copy accuracy at <= 128 bytes is above chance ({chance} per "
            "character); *retrieves far* when it copies and copy accuracy at the longest distance keeps at "
            "least half of that and its lower end stays above chance.\n"
        )
        + ("\nOver each scheme's training seeds:\n\n" + "\n".join(across) + "\n" if across else "")
    )


def buys_row(results: Results, model: str, lines: list[str]) -> str:
    """One model's row of `what_each_scheme_buys`, appended to `lines`; its verdict."""
    quality = {float(k): v for k, v in results.quality.get(model, {}).items() if v is not None}
    copy = results.probe(model, "copy")
    near, far = pooled(copy, 128), largest(copy)
    natural = results.probe(model, "natural")
    far_natural = largest({k: v for k, v in natural.items() if v is not None})
    longest = max(quality, default=None)
    decided = verdict(quality, near, far, results.span_chance)
    shown = label(results, model) if model in results.schemes else model
    lines.append(
        f"| {shown} | {fmt(quality.get(1.0))} | {fmt(quality.get(longest) if longest else None)} "
        f"({longest:g}x) | {cell(near)} | {cell(far)} | {cell(largest(results.probe(model, 'passkey')))} | "
        f"{cell(far_natural, 3)} | {decided} |"
        if longest
        else f"| {shown} | - | - | {cell(near)} | {cell(far)} | - | - | {decided} |"
    )
    return decided


def training_section(training: dict[str, TrainingCurve]) -> str:
    """When each scheme starts to copy under the one recipe behind the served weights."""
    if not training:
        return "The served weights' training logs carry no copy-probe points (trained before they were logged).\n"
    commands = sorted({str(entry["command"]) for entry in training.values() if entry.get("command")})
    recipe = "\n".join(f"    {command}" for command in commands) or "    (runs still going: no training.json yet)"
    table = emergence.table({scheme: dict(entry) for scheme, entry in training.items()})
    return f"""Copy accuracy (`models.copy_probe` on validation text, at every evaluation of the training run) and
validation bits per byte against training tokens. A scheme copies once its accuracy is at least
{emergence.COPIES} at D = {" and ".join(map(str, emergence.DISTANCES))} bytes; one that never does is marked at the
recipe's cap. The weights come from one recipe:

{recipe}

![copy emergence](copy_emergence.png)

{table}
"""


def runs_line(results: Results) -> str:
    """Which sections later runs measured again, and at which commit (none: an empty string)."""
    lines = []
    for run in results.config.get("runs", [])[1:]:
        commit = run["environment"]["commit"]
        short = commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")
        schemes = f" ({', '.join(run['schemes'])})" if "schemes" in run else ""
        lines.append(f"\nRerun: {', '.join(run['sections'])}{schemes} at `{short}`.")
    return "".join(lines)
