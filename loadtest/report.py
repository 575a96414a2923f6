"""Tables and plots from a comparison's results.json: `python -m loadtest.report reports/<run-id>`.

Everything is drawn from results.json, so a report can be redrawn without measuring again. Every
series takes its colour and marker from loadtest/palette.py (one per scheme, rope's scaling
variants as shades of rope's), so a scheme looks the same in every figure.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from contract.cache_policy import parse_cache_policy
from loadtest.cache_budget import COST_HISTORY, policy_budget
from loadtest.palette import HEATMAP, REFERENCE, TEXT_ON_DARK, TEXT_ON_LIGHT, policy_style, style
from loadtest.probes import wilson
from models import emergence

PLOTS = {
    "bpb_vs_context.png": "Bits per byte versus context length",
    "itl_vs_context.png": "Inter-token latency versus context",
    "ttft_vs_prompt.png": "Time to first token versus prompt length",
    "throughput_vs_concurrency.png": "Throughput versus concurrency",
    "goodput_vs_users.png": "Goodput versus users, without and with admission control",
    "kv_bytes.png": "KV bytes per sequence by cache policy and context length",
    "retrieval.png": "Retrieval probes with 95% intervals",
    "retrieval_depth.png": "Copy accuracy by context length and depth of the first copy",
    "cache_budget.png": "Quality against KV bytes per sequence, per cache policy",
    "copy_emergence.png": "Copy accuracy and validation bits per byte against training tokens",
}


def _fmt(value: float | None, digits: int = 3, scale: float = 1.0, missing: str = "not servable") -> str:
    return missing if value is None else f"{value * scale:.{digits}f}"


def _series(data: dict[str, float | None]) -> tuple[list[float], list[float]]:
    points = [(float(k), v) for k, v in data.items() if v is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _train(results: dict) -> int:  # type: ignore[type-arg]
    return next(iter(results["models"].values()))["train_context"] if results["models"] else 256


def figure_bpb(results: dict) -> Figure:  # type: ignore[type-arg]
    """Bits per byte against context: the schemes as lines, rope's scaling variants as points."""
    train = _train(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme in results["schemes"]:
        xs, ys = _series(results["quality"].get(scheme, {}))
        ax.plot([x * train for x in xs], ys, label=scheme, **style(scheme).kwargs())
    for name, data in results["quality"].items():
        if name not in results["schemes"]:  # scaling variants (rope-ntk-x4, ...)
            xs, ys = _series(data)
            ax.scatter([x * train for x in xs], ys, label=name, **style(name).kwargs())
    ax.axvline(train, color=REFERENCE, linestyle=":", label="training context")
    ax.set(
        xscale="log",
        xlabel="context length (bytes)",
        ylabel="bits per byte (held-out)",
        title=PLOTS["bpb_vs_context.png"],
    )
    ax.legend(fontsize=7, ncol=2)
    return fig


def figure_latency(results: dict, key: str, name: str, xlabel: str) -> Figure:  # type: ignore[type-arg]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme in results["schemes"]:
        xs, ys = _series(results[key].get(scheme, {}))
        ax.plot(xs, [y * 1000 for y in ys], label=scheme, **style(scheme).kwargs())
    ax.set(xscale="log", xlabel=xlabel, ylabel="milliseconds (median)", title=PLOTS[name])
    ax.legend(fontsize=8)
    return fig


def figure_throughput(results: dict) -> Figure:  # type: ignore[type-arg]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme in results["schemes"]:
        load = results["load"].get(scheme, {})
        users = sorted(load, key=int)
        ax.plot([int(u) for u in users], [load[u]["tokens_per_s"] for u in users], label=scheme,
                **style(scheme).kwargs())  # fmt: skip
    ax.set(xlabel="concurrent users", ylabel="generated tokens/s", title=PLOTS["throughput_vs_concurrency.png"])
    ax.legend(fontsize=8)
    return fig


def figures(results: dict) -> dict[str, Figure]:  # type: ignore[type-arg]
    """Every figure the results allow, by file name (built, not saved: tests inspect them)."""
    builders: dict[str, Callable[[], Figure]] = {
        "bpb_vs_context.png": lambda: figure_bpb(results),
        "itl_vs_context.png": lambda: figure_latency(results, "itl", "itl_vs_context.png", "context length (bytes)"),
        "ttft_vs_prompt.png": lambda: figure_latency(results, "ttft", "ttft_vs_prompt.png", "prompt length (bytes)"),
        "throughput_vs_concurrency.png": lambda: figure_throughput(results),
        "retrieval.png": lambda: figure_retrieval(results),
        "retrieval_depth.png": lambda: figure_retrieval_depth(results),
    }
    if results.get("load_admission"):
        builders["goodput_vs_users.png"] = lambda: figure_goodput(results)
    if results.get("training"):
        builders["copy_emergence.png"] = lambda: figure_emergence(results["training"])
    if results.get("cache_budget"):
        builders["kv_bytes.png"] = lambda: figure_kv_bytes(results)
        builders["cache_budget.png"] = lambda: figure_cache_budget(results)
    return {name: build() for name, build in builders.items()}


def plot(results: dict, out: Path) -> None:  # type: ignore[type-arg]
    for name, fig in figures(results).items():
        if not fig.get_layout_engine():
            fig.tight_layout()
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)


def _cells(cells: dict[str, dict[str, float] | None]) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, value, and the distances to the interval's ends (for error bars), servable cells only."""
    points = sorted((float(k), c) for k, c in cells.items() if c is not None and k != "all")
    xs = [x for x, _ in points]
    values = [c["value"] for _, c in points]
    below = [max(0.0, c["value"] - c["low"]) if c["low"] == c["low"] else 0.0 for _, c in points]
    above = [max(0.0, c["high"] - c["value"]) if c["high"] == c["high"] else 0.0 for _, c in points]
    return xs, values, below, above


def figure_retrieval(results: dict) -> Figure:  # type: ignore[type-arg]
    train = _train(results)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    panels = (
        ("copy", "filler between the two copies (bytes)", "share of the copy predicted"),
        ("passkey", "context length (bytes)", "share of the key's digits predicted"),
        ("natural", "distance to the n-gram's previous occurrence (bytes, bucket edge)", "bits per byte"),
    )
    for ax, (probe, xlabel, ylabel) in zip(axes, panels, strict=True):
        for index, scheme in enumerate(results["schemes"]):
            cells = results["retrieval"].get(scheme, {}).get(probe, {})
            xs, values, below, above = _cells(cells)
            shift = 1 + (index - len(results["schemes"]) / 2) * 0.03  # side by side on a log axis
            ax.errorbar([x * shift for x in xs], values, yerr=[below, above], capsize=2, label=scheme,
                        **style(scheme).kwargs())  # fmt: skip
        ax.axvline(train, color=REFERENCE, linestyle=":", label="training context")
        ax.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title=probe)
        ticks = sorted({float(k) for c in results["retrieval"].values() for k in c.get(probe, {}) if k != "all"})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
        ax.minorticks_off()
        if probe != "natural":
            ax.set_ylim(-0.02, 1.02)
    axes[0].legend(fontsize=7)
    fig.suptitle(PLOTS["retrieval.png"])
    return fig


def figure_retrieval_depth(results: dict) -> Figure:  # type: ignore[type-arg]
    schemes = results["schemes"]
    columns = min(3, max(1, len(schemes)))
    rows = -(-len(schemes) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.4 * rows), squeeze=False, layout="constrained")
    image = None
    for ax, scheme in zip(axes.flat, schemes, strict=False):
        grid = results["retrieval"].get(scheme, {}).get("copy_depth", {})
        contexts = sorted(grid, key=int)
        depths = sorted(next(iter(grid.values()), {}), key=float)
        values = [[(grid[c][d] or {}).get("value", float("nan")) for c in contexts] for d in depths]
        image = ax.imshow(values, vmin=0, vmax=1, cmap=HEATMAP, aspect="auto")
        for row, d in enumerate(depths):
            for column, c in enumerate(contexts):
                cell = grid[c][d]
                dark = cell is None or cell["value"] < 0.6
                ax.text(column, row, "n/a" if cell is None else f"{cell['value']:.2f}", ha="center", va="center",
                        fontsize=8, color=TEXT_ON_DARK if dark else TEXT_ON_LIGHT)  # fmt: skip
        ax.set_xticks(range(len(contexts)), contexts, fontsize=7)
        ax.set_yticks(range(len(depths)), depths, fontsize=7)
        ax.set(title=scheme, xlabel="context (bytes)", ylabel="depth of the first copy")
    for ax in list(axes.flat)[len(schemes) :]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="share of the copy predicted")
    fig.suptitle(PLOTS["retrieval_depth.png"])
    return fig


def figure_goodput(results: dict) -> Figure:  # type: ignore[type-arg]
    """Goodput (solid: admit everything; dashed: --ttft-slo-seconds) and refusals per second."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for scheme in results["schemes"]:
        for key, line, label in (("load", "-", scheme), ("load_admission", "--", f"{scheme}, admission")):
            load = results.get(key, {}).get(scheme, {})
            users = sorted(load, key=int)
            axes[0].plot([int(u) for u in users], [load[u]["goodput_per_s"] for u in users], line, label=label,
                         **style(scheme).kwargs())  # fmt: skip
            if key == "load_admission":
                axes[1].plot([int(u) for u in users], [load[u].get("refused_per_s", 0.0) for u in users], line,
                             label=scheme, **style(scheme).kwargs())  # fmt: skip
    axes[0].set(
        xlabel="concurrent users", ylabel="goodput (requests/s within targets)", title=PLOTS["goodput_vs_users.png"]
    )
    axes[1].set(xlabel="concurrent users", ylabel="refused requests/s (RESOURCE_EXHAUSTED)",
                title="Requests refused by admission control")  # fmt: skip
    axes[0].legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    axes[1].legend(fontsize=7)
    return fig


def figure_emergence(training: dict) -> Figure:  # type: ignore[type-arg]
    """Copy accuracy at each probed distance and validation bpb against training tokens, one line per
    scheme; the copying bar, each scheme's first copying point (dotted) and the cap where one never copies."""
    panels = len(emergence.DISTANCES) + 1
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.2))
    for scheme, entry in training.items():
        points = [p for p in entry["points"] if p["tokens"] is not None]  # a log from before tokens were logged
        if not points:
            continue
        tokens = [p["tokens"] / 1e6 for p in points]
        kwargs = style(scheme).kwargs() | {"markersize": 3}
        for ax, distance in zip(axes, emergence.DISTANCES, strict=False):
            ax.plot(tokens, [p[str(distance)] for p in points], label=scheme, **kwargs)
        axes[-1].plot(tokens, [p["val_bpb"] for p in points], label=scheme, **kwargs)
        if entry["copies_at"] is not None:
            for ax in axes[:-1]:
                ax.axvline(entry["copies_at"]["tokens"] / 1e6, linestyle=":", color=style(scheme).color)
        elif entry["finished"]:
            for ax in axes[:-1]:
                ax.annotate("cap", (tokens[-1], points[-1][str(emergence.DISTANCES[0])]), color=style(scheme).color)
    for ax, distance in zip(axes, emergence.DISTANCES, strict=False):
        ax.axhline(emergence.COPIES, linestyle="--", color=REFERENCE, linewidth=0.8)
        ax.set(xlabel="training tokens (M)", ylabel=f"copy accuracy, D = {distance} bytes", ylim=(-0.02, 1.02),
               title=f"Copying at D = {distance}")  # fmt: skip
    axes[-1].set(xlabel="training tokens (M)", ylabel="validation bits per byte", title="Validation bpb @ 256")
    axes[-1].set_ylim(top=min(3.5, axes[-1].get_ylim()[1]))
    axes[0].legend(fontsize=7)
    fig.suptitle(PLOTS["copy_emergence.png"])
    return fig


def training_section(results: dict) -> str:  # type: ignore[type-arg]
    """When each scheme starts to copy under the one recipe behind the served weights."""
    training = results.get("training")
    if not training:
        return "The served weights' training logs carry no copy-probe points (trained before they were logged).\n"
    commands = sorted({str(entry["command"]) for entry in training.values() if entry.get("command")})
    recipe = "\n".join(f"    {command}" for command in commands) or "    (runs still going: no training.json yet)"
    return f"""Copy accuracy (`models.copy_probe` on validation text, at every evaluation of the training run) and
validation bits per byte against training tokens. A scheme copies once its accuracy is at least
{emergence.COPIES} at D = {" and ".join(map(str, emergence.DISTANCES))} bytes; one that never does is marked at the
recipe's cap. The weights come from one recipe:

{recipe}

![copy emergence](copy_emergence.png)

{emergence.table(training)}
"""


def goodput_section(results: dict) -> str:  # type: ignore[type-arg]
    """Goodput with and without admission control, and the ratio the issue set as its goal: goodput
    at the most users over the best goodput at any fewer users."""
    admission = results.get("load_admission", {})
    if not admission:
        return "No admission-control series in this run.\n"
    rows = ["| scheme | users | goodput req/s | with admission | refused/s with admission | TTFT p50 ms | "
            "with admission |", "|" + "---|" * 7]  # fmt: skip
    top = max((u for load in admission.values() for u in load), key=int, default="?")
    ratios = [f"| scheme | goodput ratio without admission | with admission (goal >= {GOODPUT_RATIO_GOAL:g}) | "
              f"goodput req/s @{top} | refused/s @{top} | refusals per good request @{top} "
              f"(goal <= {REFUSALS_PER_GOOD_GOAL:g}) |", "|" + "---|" * 6]  # fmt: skip
    for scheme in results["schemes"]:
        plain, shed = results["load"].get(scheme, {}), admission.get(scheme, {})
        users = sorted(set(plain) | set(shed), key=int)
        for u in users:
            a, b = plain.get(u, {}), shed.get(u, {})
            rows.append(
                f"| {scheme} | {u} | {_fmt(a.get('goodput_per_s'), 2, missing='-')} | "
                f"{_fmt(b.get('goodput_per_s'), 2, missing='-')} | {_fmt(b.get('refused_per_s'), 1, missing='-')} | "
                f"{_fmt(a.get('ttft_p50_s'), 0, 1000, '-')} | {_fmt(b.get('ttft_p50_s'), 0, 1000, '-')} |"
            )
        last = shed.get(top, {})
        ratios.append(f"| {scheme} | {_fmt(goodput_ratio(plain), 2, missing='-')} | "
                      f"{_fmt(goodput_ratio(shed), 2, missing='-')} | "
                      f"{_fmt(last.get('goodput_per_s'), 2, missing='-')} | "
                      f"{_fmt(last.get('refused_per_s'), 1, missing='-')} | "
                      f"{_fmt(refusals_per_good(last), 2, missing='-')} |")  # fmt: skip
    slo = results["config"].get("admission_ttft_slo_s")
    return (
        f"The same closed-loop load against a server started with `--ttft-slo-seconds {slo}`: a request\n"
        "estimated to miss it is refused at once (RESOURCE_EXHAUSTED, `retry-after-ms` hint: when it\n"
        "would meet the target, behind the requests refused before it; the load clients wait as asked),\n"
        "so the requests it admits stay within the goodput targets.\n\n"
        "![goodput](goodput_vs_users.png)\n\n" + "\n".join(rows) + "\n\n"
        "Goodput at the most users over the best goodput at fewer users (1.0: no collapse), and refusals\n"
        "per good request there (each refusal is a round trip of the CPU the admitted requests need):\n\n"
        + "\n".join(ratios)
        + "\n"
    )


GOODPUT_RATIO_GOAL = 0.8  # issue 22: goodput at the most users over the best at fewer, with admission
REFUSALS_PER_GOOD_GOAL = 3.0  # issue 22: refusals/s at the most users over goodput/s there


def refusals_per_good(load: dict[str, float]) -> float | None:
    """Refusals per second over goodput per second at one load (None without goodput)."""
    good = load.get("goodput_per_s")
    return load.get("refused_per_s", 0.0) / good if good else None


def goodput_ratio(load: dict[str, dict[str, float]]) -> float | None:
    users = sorted(load, key=int)
    if len(users) < 2:
        return None
    best = max(load[u]["goodput_per_s"] for u in users[:-1])
    return load[users[-1]]["goodput_per_s"] / best if best else None


def headline_table(results: dict) -> str:  # type: ignore[type-arg]
    multiples = sorted({m for s in results["schemes"] for m in results["quality"].get(s, {})}, key=float)
    users = sorted({u for s in results["schemes"] for u in results["load"].get(s, {})}, key=int)
    top = users[-1] if users else None
    itl_ctx = max((int(c) for s in results["schemes"] for c in results["itl"].get(s, {})), default=0)
    header = ["scheme", *[f"bpb@{m}x" for m in multiples], f"ITL ms @{itl_ctx}"]
    if top:
        header += [f"p99 s @{top} users", f"tokens/s @{top}", f"goodput req/s @{top}"]
    header += ["KV B/token", "copy @<=128 B", "copy @8x", "passkey @8x"]
    cache = results.get("cache_budget") or {}
    if cache:  # what a bounded or int8 cache keeps: bpb at the longest text under window:256, int8 at 1x
        header += ["bpb@8x window:256", "bpb@8x sinks:4+window:252", "int8 bpb change @1x"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for scheme in results["schemes"]:
        quality = results["quality"].get(scheme, {})
        load = results["load"].get(scheme, {}).get(top, {}) if top else {}
        cells = [
            scheme,
            *[_fmt(quality.get(m)) for m in multiples],
            _fmt(results["itl"].get(scheme, {}).get(str(itl_ctx)), 2, 1000),
        ]
        if top:
            cells += [_fmt(load.get("p99_s"), 2), _fmt(load.get("tokens_per_s"), 0), _fmt(load.get("goodput_per_s"), 2)]
        probes = results["retrieval"].get(scheme, {})
        cells += [
            str(results["models"].get(scheme, {}).get("kv_bytes_per_token", "")),
            _cell(pooled(probes.get("copy", {}), 128)),
            _cell(_largest(probes.get("copy", {}))),
            _cell(_largest(probes.get("passkey", {}))),
        ]
        if cache:
            bpb = cache.get(scheme, {}).get("bpb", {})
            longest = max((m for cells_ in bpb.values() for m in cells_), key=float, default="8")
            int8 = cache.get(scheme, {}).get("int8", {})
            full, quantized = int8.get("full", {}).get("1"), int8.get("int8", {}).get("1")
            change = f"{(quantized / full - 1) * 100:+.2f}%" if full and quantized else "not measured"
            cells += [
                _fmt(bpb[policy].get(longest)) if policy in bpb else "not measured"
                for policy in ("window:256", "sinks:4+window:252")
            ]
            cells.append(change)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


CHANCE_SPAN_CHARACTER = 1 / 36  # a random span character: a lowercase letter or a digit


def _cell(cell: dict[str, float] | None, digits: int = 2) -> str:
    """'0.95 [0.90, 0.98]': a figure and its 95% interval."""
    if cell is None:
        return "not servable"
    return f"{cell['value']:.{digits}f} [{cell['low']:.{digits}f}, {cell['high']:.{digits}f}]"


def pooled(cells: dict[str, dict[str, float] | None], up_to: int) -> dict[str, float] | None:
    """The copy cells at distances <= `up_to` bytes taken together (their trials pooled)."""
    chosen = [c for k, c in cells.items() if k != "all" and int(k) <= up_to and c is not None]
    n = sum(int(c["n"]) for c in chosen)
    if not n:
        return None
    return wilson(sum(c["value"] * c["n"] for c in chosen) / n, n).as_dict()


def _largest(cells: dict[str, dict[str, float] | None]) -> dict[str, float] | None:
    """The cell at the longest length (None if the model cannot take it)."""
    keys = sorted((k for k in cells if k != "all"), key=int)
    return cells[keys[-1]] if keys else None


def probe_table(title: str, results: dict, probe: str, column: str) -> str:  # type: ignore[type-arg]
    data = {s: results["retrieval"].get(s, {}).get(probe, {}) for s in results["schemes"]}
    keys = sorted({k for v in data.values() for k in v if k != "all"}, key=int)
    extra = ["all"] if any("all" in v for v in data.values()) else []
    lines = [f"### {title}", "", f"| scheme \\ {column} | " + " | ".join(keys + extra) + " |",
             "|---|" + "---|" * (len(keys) + len(extra))]  # fmt: skip
    digits = 3 if probe == "natural" else 2
    for scheme, row in data.items():
        lines.append(f"| {scheme} | " + " | ".join(_cell(row.get(k), digits) for k in keys + extra) + " |")
    return "\n".join(lines) + "\n"


def depth_table(results: dict) -> str:  # type: ignore[type-arg]
    grids = {s: results["retrieval"].get(s, {}).get("copy_depth", {}) for s in results["schemes"]}
    depths = sorted({d for grid in grids.values() for row in grid.values() for d in row}, key=float)
    lines = ["### Copy accuracy by context length and depth of the first copy", "",
             "| scheme | context bytes | " + " | ".join(f"depth {d}" for d in depths) + " |",
             "|---|---|" + "---|" * len(depths)]  # fmt: skip
    for scheme, grid in grids.items():
        for context in sorted(grid, key=int):
            cells = " | ".join(_cell(grid[context].get(d)) for d in depths)
            lines.append(f"| {scheme} | {context} | {cells} |")
    return "\n".join(lines) + "\n"


def what_each_scheme_buys(results: dict) -> str:  # type: ignore[type-arg]
    """Extrapolation (bits per byte past the training context) beside retrieval, per scheme, and
    where the two disagree. The verdicts are rules over the measured figures, stated below."""
    lines = ["| scheme | bpb @1x | bpb @longest servable | copy @<=128 B | copy @longest | passkey @longest "
             "| repeated-n-gram bpb, farthest bucket | verdict |", "|" + "---|" * 8]  # fmt: skip
    for scheme in results["schemes"]:
        quality = {float(k): v for k, v in results["quality"].get(scheme, {}).items() if v is not None}
        probes = results["retrieval"].get(scheme, {})
        near, far = pooled(probes.get("copy", {}), 128), _largest(probes.get("copy", {}))
        natural = probes.get("natural", {})
        far_natural = _largest({k: v for k, v in natural.items() if v is not None})
        longest = max(quality, default=None)
        base = quality.get(1.0)
        extrapolates = base is not None and longest is not None and longest > 1 and quality[longest] <= 1.15 * base
        copies = near is not None and near["low"] > CHANCE_SPAN_CHARACTER
        retrieves = (
            copies and far is not None and far["value"] >= 0.5 * near["value"] and far["low"] > CHANCE_SPAN_CHARACTER
        )
        if far is None or longest is None or longest <= 1:
            verdict = "bounded: cannot take contexts past its positions"
        elif extrapolates and not retrieves:
            verdict = "disagree: bits per byte extrapolate, far retrieval does not"
        elif retrieves and not extrapolates:
            verdict = "disagree: retrieves far, but bits per byte degrade past the training context"
        elif retrieves:
            verdict = "agree: extrapolates and retrieves far"
        else:
            verdict = "agree: neither extrapolates nor retrieves far" + ("" if copies else " (does not copy at all)")
        lines.append(
            f"| {scheme} | {_fmt(base)} | {_fmt(quality.get(longest) if longest else None)} "
            f"({longest:g}x) | {_cell(near)} | {_cell(far)} | {_cell(_largest(probes.get('passkey', {})))} | "
            f"{_cell(far_natural, 3)} | {verdict} |"
            if longest
            else f"| {scheme} | - | - | {_cell(near)} | {_cell(far)} | - | - | {verdict} |"
        )
    return "\n".join(lines) + (
        "\n\nRules: *extrapolates* when bits per byte at the longest servable multiple stay within 15% of "
        "1x; *copies* when the lower end of copy accuracy at <= 128 bytes is above chance (1/36 per "
        "character); *retrieves far* when it copies and copy accuracy at the longest distance keeps at "
        "least half of that and its lower end stays above chance.\n"
    )


def _grid_table(title: str, data: dict, scale: float, digits: int) -> str:  # type: ignore[type-arg]
    keys = sorted({k for v in data.values() for k in v}, key=float)
    lines = [f"### {title}", "", "| scheme | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for scheme, row in data.items():
        lines.append(f"| {scheme} | " + " | ".join(_fmt(row.get(k), digits, scale) for k in keys) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- cache budgets


def _policy_tokens(policy: str, full_tokens: int) -> int:
    """Tokens a policy's cache holds for a text of `full_tokens` (full: all of them)."""
    budget = policy_budget(policy)
    return full_tokens if budget is None else min(budget, full_tokens)


# ----------------------------------------------------------------------------------------- memory

WITHIN = 0.05  # quality kept: bits per byte at most 5% above the full cache's on the same texts
PANELS = (("window", "window:W (the last W tokens)"), ("sinks", "sinks:4+window:W-4 (StreamingLLM)"))


def measured_bpb(figures: dict) -> dict[str, dict[str, float | None]]:  # type: ignore[type-arg]
    """One scheme's bits per byte by policy and multiple of the training context: the bpb tables
    and the int8 table (its `full` row, fp32 at the int8 table's lengths, joins `full`)."""
    merged = {policy: dict(cells) for policy, cells in figures["bpb"].items()}
    for policy, cells in figures.get("int8", {}).items():
        merged.setdefault(policy, {}).update({k: v for k, v in cells.items() if "@" not in k})
    return merged


def int8_ratio(data: dict) -> float | None:  # type: ignore[type-arg]
    """int8 K/V bytes over float32's per token, from the allocations measured for `int8` and `full`
    (the same tokens in the same capacity classes; per-token scales included)."""
    for figures in data.values():
        full, quantized = figures["cost"].get("full"), figures["cost"].get("int8")
        if full and quantized:
            return float(quantized["kv_physical_bytes"] / full["kv_physical_bytes"])
    return None


def sequence_bytes(policy: str, tokens: int, bytes_per_token: float, ratio: float | None) -> float:
    """KV bytes one sequence of `tokens` tokens holds under `policy` (the tokens it keeps, whole)."""
    parsed = parse_cache_policy(policy)
    per_token = bytes_per_token * (ratio if parsed.int8 and ratio else 1.0)
    return parsed.cached(tokens) * per_token


def _in_panel(policy: str, kind: str | None) -> bool:
    """Unbounded policies (full, int8) belong to every panel; a bounded one to its own form's."""
    parsed = parse_cache_policy(policy)
    return kind is None or not parsed.bounded or parsed.form.removesuffix("+int8") == kind


def cheapest_within(
    figures: dict,  # type: ignore[type-arg]
    multiple: str,
    train: int,
    ratio: float | None,
    kind: str | None = None,
) -> tuple[str, float, float] | None:
    """The policy keeping the fewest KV bytes whose bits per byte at `multiple` stay within WITHIN of
    the full cache's: (policy, bytes per sequence, bpb change); None where the full cache is not
    servable. Ties go to the first measured (full before the bounded policies)."""
    bpb = measured_bpb(figures)
    full = bpb.get("full", {}).get(multiple)
    if full is None:
        return None
    tokens = round(float(multiple) * train)
    candidates = [
        (sequence_bytes(policy, tokens, figures["bytes_per_token"], ratio), policy, cells[multiple] / full - 1)
        for policy, cells in bpb.items()
        if cells.get(multiple) is not None
        and cells[multiple] <= full * (1 + WITHIN)
        and _in_panel(policy, kind)
        and (ratio or not parse_cache_policy(policy).int8)
    ]
    nbytes, policy, change = min(candidates, key=lambda c: c[0])
    return policy, nbytes, change


def _multiples(data: dict) -> list[str]:  # type: ignore[type-arg]
    return sorted({m for f in data.values() for cells in measured_bpb(f).values() for m in cells}, key=float)


def figure_kv_bytes(results: dict) -> Figure:  # type: ignore[type-arg]
    """KV bytes per sequence against context length, one line per cache policy measured (full,
    window, sinks, int8), and per scheme a marker at each measured length on the cheapest policy
    whose bits per byte stay within 5% of its full cache: the memory each scheme needs."""
    data = results["cache_budget"]
    train = _train(results)
    ratio = int8_ratio(data)
    per_token = next(iter(data.values()))["bytes_per_token"]
    policies = list(dict.fromkeys(p for f in data.values() for p in measured_bpb(f)))
    policies = [p for p in policies if ratio or not parse_cache_policy(p).int8]
    budgets = sorted({b for p in policies if (b := parse_cache_policy(p).budget) is not None})
    multiples = _multiples(data)
    longest = max(COST_HISTORY, round(float(multiples[-1]) * train))
    contexts = np.geomspace(min(budgets, default=train) / 2, longest * 1.1, 200)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, (kind, title) in zip(axes, PANELS, strict=True):
        for policy in (p for p in policies if _in_panel(p, kind)):
            parsed = parse_cache_policy(policy)
            rank = None if parsed.budget is None else budgets.index(parsed.budget)
            xs = [t for t in contexts if t >= (parsed.budget or 0)]  # below its budget a policy is its full form
            ys = [sequence_bytes(policy, round(t), per_token, ratio) for t in xs]
            ax.plot(xs, ys, label=policy, linewidth=1.2, **policy_style(parsed.int8, rank))
        allocated = [
            (sequence_bytes(policy, COST_HISTORY, per_token, ratio), cost["kv_physical_bytes"])
            for policy in policies
            if _in_panel(policy, kind)
            for cost in [next((f["cost"].get(policy) for f in data.values() if f["cost"].get(policy)), None)]
            if cost
        ]
        if allocated:
            ax.scatter([COST_HISTORY] * len(allocated), [a for _, a in allocated], marker="_", s=120,
                       color=REFERENCE, label=f"allocated at {COST_HISTORY} tokens (measured)")  # fmt: skip
        for index, scheme in enumerate(results["schemes"]):
            shift = 1 + (index - len(results["schemes"]) / 2) * 0.05  # side by side on a log axis
            points = [
                (float(m) * train * shift, chosen[1])
                for m in multiples
                if (chosen := cheapest_within(data.get(scheme, {"bpb": {}}), m, train, ratio, kind)) is not None
            ]
            ax.plot([x for x, _ in points], [y for _, y in points], linestyle="none", markersize=8, label=scheme,
                    markeredgecolor=TEXT_ON_LIGHT, markeredgewidth=0.5, **style(scheme).kwargs())  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens = bytes)", title=title)
        ticks = [t for t in (2**k for k in range(4, 16)) if contexts[0] <= t <= longest]
        ax.set_xticks(ticks, [f"{t}" for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc="upper left")
    yticks = [v for v in (2**k * 1024 for k in range(4, 16)) if axes[0].get_ylim()[0] <= v <= axes[0].get_ylim()[1]]
    axes[0].set_yticks(yticks, [_bytes(v) for v in yticks])
    axes[0].set_ylabel("KV bytes per sequence")
    fig.suptitle(
        f"{PLOTS['kv_bytes.png']}: markers, each scheme's cheapest policy whose bits per byte stay within "
        f"{WITHIN:.0%} of its full cache at that length",
        fontsize=10,
    )
    return fig


def _bytes(value: float) -> str:
    return f"{value / 2**20:g} MiB" if value >= 2**20 else f"{value / 1024:g} KiB"


def memory_section(results: dict) -> str:  # type: ignore[type-arg]
    """The figure and, per scheme and length, the cheapest policy within WITHIN of the full cache."""
    data = results.get("cache_budget") or {}
    if not data:
        return "The cache-budget section was not measured in this run (`--sections cache`): no memory figure.\n"
    train, ratio = _train(results), int8_ratio(data)
    multiples = _multiples(data)
    lines = [f"| scheme | {' | '.join(f'{round(float(m) * train)} tokens ({m}x)' for m in multiples)} |",
             "|---|" + "---|" * len(multiples)]  # fmt: skip
    for scheme in results["schemes"]:
        cells = []
        for m in multiples:
            chosen = cheapest_within(data.get(scheme, {"bpb": {}}), m, train, ratio)
            cells.append("not servable" if chosen is None else f"{chosen[0]}: {_bytes(chosen[1])} ({chosen[2]:+.1%})")
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
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
        + (f", {ratio:.3f}" if ratio else "")
        + "); the store allocates rows in capacity classes, so what it holds is up to one class more "
        f"(the dashes at {COST_HISTORY} tokens: allocations measured from /metrics).\n\n" + "\n".join(lines) + "\n"
    )


def figure_cache_budget(results: dict) -> Figure:  # type: ignore[type-arg]
    """bpb at the longest text against KV bytes per sequence, one line per scheme, a panel per eviction kind."""
    data = results["cache_budget"]
    train = next(iter(results["models"].values()))["train_context"]
    longest = max(float(m) for c in data.values() for m in next(iter(c["bpb"].values())))
    kinds = (("window", "window:W (the last W tokens)"), ("sinks", "sinks:4+window:W-4 (StreamingLLM)"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for ax, (kind, title) in zip(axes, kinds, strict=True):
        for scheme, figures in data.items():
            points = []
            for policy, cells in figures["bpb"].items():
                value = cells.get(f"{longest:g}")
                if value is None or not (policy == "full" or policy.startswith(kind)):
                    continue
                tokens = _policy_tokens(policy, int(longest * train))
                points.append((tokens * figures["bytes_per_token"], value))
            if points:
                points.sort()
                ax.plot([p[0] / 1e6 for p in points], [p[1] for p in points], label=scheme, **style(scheme).kwargs())
        ax.set(xscale="log", xlabel="KV bytes per sequence (tokens kept; rightmost: the full cache)", title=title)
        per_token = next(iter(data.values()))["bytes_per_token"]
        kept = sorted({_policy_tokens(p, int(longest * train)) for f in data.values() for p in f["bpb"]})
        ax.set_xticks([t * per_token / 1e6 for t in kept], [f"{t * per_token / 1e6:.2f} MB\n({t})" for t in kept])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"bits per byte at {longest:g}x the training context")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        PLOTS["cache_budget.png"] + f" ({longest * train:.0f}-byte held-out texts, streamed through the cache)"
    )
    return fig


def cache_budget_section(results: dict) -> str:  # type: ignore[type-arg]
    data = results.get("cache_budget") or {}
    if not data:
        return "Not measured in this run (`--sections cache`).\n"
    runs = [r for r in results["config"].get("runs", []) if "cache" in r["sections"]]
    budget = runs[-1]["budget"] if runs else results["config"].get("budget", {})
    policies = next(iter(data.values()))["policies"]
    multiples = sorted({m for c in data.values() for cells in c["bpb"].values() for m in cells}, key=float)
    lines: list[str] = []
    for multiple in multiples:
        lines += [f"### Bits per byte at {multiple}x the training context, by cache policy", "",
                  "| scheme | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]  # fmt: skip
        for scheme, figures in data.items():
            cells = [_fmt(figures["bpb"][p].get(multiple)) for p in policies]
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
                f"| {scheme} | " + " | ".join(_cell(figures["retrieval"][p].get(probe)) for p in policies) + " |"
            )
        lines.append("")
    int8_rows = [(s, f["int8"]) for s, f in data.items() if f.get("int8")]
    if int8_rows:
        lines += ["### int8 K/V against full precision", "",
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
                    base, value = fp32.get(m) or full.get(m), cells.get(m)
                    changes.append("" if base is None or value is None else f"{(value / base - 1) * 100:+.2f}%")
                if policy == "full":  # its probes are in the retrieval tables
                    cells = {**data[scheme]["retrieval"].get("full", {}), **cells}
                lines.append(
                    f"| {scheme} | {policy} | {_fmt(cells.get('1'))} | {_fmt(cells.get('4'))} | "
                    f"{changes[0]} | {changes[1]} | {_cell(cells.get('copy@32'))} | {_cell(cells.get('copy@512'))} |"
                )
        lines.append("")
    cost_policies = list(dict.fromkeys(p for f in data.values() for p in f["cost"]))
    lines += ["### Cost: KV bytes allocated per sequence and inter-token latency at 2048 tokens of history", "",
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
    lines += ["", cache_budget_goals(data, multiples), ""]
    trials, windows = budget.get("cache_trials", "?"), budget.get("cache_windows", "?")
    note = (
        "Texts stream through the policy one token at a time past the budget (StreamingLLM's evaluation); "
        f"{windows} held-out texts per bpb cell, {trials} probes per retrieval cell."
    )
    if runs:
        note += f" Measured at commit `{runs[-1]['environment']['commit']}`."
    return note + "\n\n![quality against KV bytes](cache_budget.png)\n\n" + "\n".join(lines)


def cache_budget_goals(data: dict, multiples: list[str]) -> str:  # type: ignore[type-arg]
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
        full, quantized = int8.get("full", {}).get("1"), int8.get("int8", {}).get("1")
        if full and quantized:
            change = (quantized / full - 1) * 100
            bytes_int8 = (figures["cost"].get("int8") or {}).get("kv_physical_bytes")
            bytes_full = (figures["cost"].get("full") or {}).get("kv_physical_bytes")
            ratio = f", {bytes_int8 / bytes_full:.2f}x the bytes" if bytes_int8 and bytes_full else ""
            verdict = "holds" if abs(change) <= 1 else "fails"
            out.append(f"- {scheme}: int8 K/V changes bpb at 1x by {change:+.2f}%{ratio}: **{verdict}** (goal: at most "
                       "1% at a quarter of fp32's bytes).")  # fmt: skip
    return "\n".join(out)


def runs_line(results: dict) -> str:  # type: ignore[type-arg]
    """Which sections later runs measured again, and at which commit (none: an empty string)."""
    runs = results["config"].get("runs", [])[1:]
    lines = []
    for run in runs:
        commit = run["environment"]["commit"]
        short = commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")
        lines.append(f"\nRerun: {', '.join(run['sections'])} at `{short}`.")
    return "".join(lines)


def write_report(out: Path) -> Path:
    results = json.loads((out / "results.json").read_text())
    plot(results, out)
    env = results["environment"]
    budget = results["config"]["budget"]
    train_context = next(iter(results["models"].values()), {}).get("train_context", 256)
    load_rows = ["| scheme | users | requests | errors | p50 s | p95 s | p99 s | TTFT p50 ms | ITL p50 ms | tokens/s "
                 "| goodput req/s | KV peak MB | pool use |", "|" + "---|" * 13]  # fmt: skip
    for scheme, by_users in results["load"].items():
        for users, f in sorted(by_users.items(), key=lambda kv: int(kv[0])):
            load_rows.append(
                f"| {scheme} | {users} | {f['requests']} | {f['errors']} | {f['p50_s']:.3f} | {f['p95_s']:.3f} | "
                f"{f['p99_s']:.3f} | {f['ttft_p50_s'] * 1000:.1f} | {f['itl_p50_s'] * 1000:.2f} | "
                f"{f['tokens_per_s']:.0f} | {f['goodput_per_s']:.2f} | {f['kv_peak_bytes'] / 1e6:.2f} | "
                f"{f['pool_utilisation'] * 100:.2f}% |"
            )
    memory_rows = ["| scheme | KV B/token | KV peak MB | server peak MB under load (both processes) | "
                   "input embedding B/step | attention bias B/step | rotary B/step |", "|" + "---|" * 7]  # fmt: skip
    for scheme, m in results["memory"].items():
        memory_rows.append(
            f"| {scheme} | {results['models'][scheme]['kv_bytes_per_token']} | {m['kv_peak_bytes'] / 1e6:.2f} | "
            f"{m['process_peak_bytes'] / 1e6:.0f} | {m['input_embedding_bytes']} | {m['attention_bias_bytes']} | "
            f"{m['rotary_bytes']} |"
        )
    retrieval = [
        probe_table(
            "Copy: share of the repeat predicted, by filler bytes between the copies", results, "copy", "bytes"
        ),
        probe_table("Passkey: share of the key's digits predicted, by context bytes", results, "passkey", "bytes"),
        probe_table(
            "Bits per byte on bytes completing a repeated 8-byte n-gram, by distance to its previous "
            "occurrence (bucket upper edge; `all`: every byte)",
            results,
            "natural",
            "bytes",
        ),
        depth_table(results),
    ]
    text = f"""# Positional-encoding comparison — run {results["run_id"]}

Measured through the gRPC service (`python -m loadtest.compare`); every raw figure is in
`results.json`. Machine: {env["cpus"]} CPUs, {env["machine"]}, {env["memory"]}; {env["platform"]}.
Versions: Python {env["python"]}, onnxruntime {env["onnxruntime"]}, torch {env["torch"]}, grpcio {env["grpcio"]}.
Commit: `{env["commit"]}`.{runs_line(results)}

## Headline

{headline_table(results)}

bpb: bits per byte on held-out text (the stdlib test split) through the `Score` RPC at multiples
of the {train_context}-byte training context; "not servable" where the scheme has no positions for that length. Goodput
counts requests with time to first token <= {results["config"]["goodput_targets"]["ttft_s"]} s and
mean inter-token latency <= {results["config"]["goodput_targets"]["itl_s"] * 1000:.0f} ms.

![bits per byte](bpb_vs_context.png)

{_grid_table("Bits per byte versus context multiple (rope-* rows: inference-time scaling)", results["quality"], 1.0, 3)}
## Latency

![inter-token latency](itl_vs_context.png) ![time to first token](ttft_vs_prompt.png)

{_grid_table("Time to first token (ms, median) versus prompt bytes", results["ttft"], 1000.0, 1)}
{_grid_table("Inter-token latency (ms, median) versus context bytes", results["itl"], 1000.0, 2)}
### Under load (closed loop, {budget["load_seconds"]} s per level, {budget["load_new_tokens"]} new tokens, sampling)

![throughput](throughput_vs_concurrency.png)

{chr(10).join(load_rows)}

### Goodput, without and with admission control

{goodput_section(results)}
## Memory

{memory_section(results)}
{chr(10).join(memory_rows)}

Per-step extras are per sequence for one decode step over 2048 keys, measured from each scheme's
positional module (a bias tensor of heads x keys for `relative` and `alibi`, rotary tables for
`rope`, an embedding row for `sinusoidal` and `learned`).

## Retrieval over distance

Graded probes through the `Score` RPC, teacher-forced, counting the bytes the model's greedy
prediction gets right ({budget["retrieval_trials"]} trials per cell; 95% Wilson intervals with one
observation per trial, since a trial's bytes are not independent). **Copy**: a random 16-character
span in held-out text, repeated after a filler of D bytes; the share of the repeat's last 8
characters predicted. **Passkey**: a 5-digit key in a line of code at a random depth, asked for at
the end (`# what was it? pass_key = "`). **Natural**: bits per byte on held-out bytes that complete a
repeated 8-byte n-gram, by how far back its previous occurrence is (interval: cluster-robust
standard error over windows). Chance for a digit is 0.1, for a span character 1/36.

![retrieval](retrieval.png)

![copy by depth](retrieval_depth.png)

{chr(10).join(retrieval)}
## What each scheme buys

{what_each_scheme_buys(results)}
## Training: when each scheme starts to copy

{training_section(results)}
## Cache budgets: what each scheme keeps when its cache is bounded

{cache_budget_section(results)}
## Config

```json
{json.dumps(results["config"], indent=2)}
```
"""
    (out / "report.md").write_text(text)
    return out / "report.md"


if __name__ == "__main__":
    write_report(Path(sys.argv[1]))
    print(Path(sys.argv[1]) / "report.md")
