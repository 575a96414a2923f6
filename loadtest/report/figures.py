"""The report's figures, drawn from the results alone. Every series takes its colour and marker from
loadtest/palette.py (one per scheme, rope's scaling variants as shades of rope's), so a scheme
looks the same in every figure."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from loadtest.palette import HEATMAP, REFERENCE, TEXT_ON_DARK, TEXT_ON_LIGHT, style
from loadtest.report.cache_figures import figure_cache_budget, figure_kv_bytes
from loadtest.report.reuse_figures import figure_repair_curve, figure_reuse
from loadtest.report.titles import PLOTS
from loadtest.study.results import ByLength, Cells, LoadFigures, Probe, Results, TrainingCurve
from models import emergence


def series(data: ByLength) -> tuple[list[float], list[float]]:
    """A figure by length as the x and y of a line, servable points only."""
    points = [(float(k), v) for k, v in data.items() if v is not None]
    return [p[0] for p in points], [p[1] for p in points]


def error_bars(cells: Cells) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, value, and the distances to the interval's ends (for error bars), servable cells only."""
    points = sorted((float(k), c) for k, c in cells.items() if c is not None and k != "all")
    xs = [x for x, _ in points]
    values = [c["value"] for _, c in points]
    below = [max(0.0, c["value"] - c["low"]) if c["low"] == c["low"] else 0.0 for _, c in points]
    above = [max(0.0, c["high"] - c["value"]) if c["high"] == c["high"] else 0.0 for _, c in points]
    return xs, values, below, above


def figure_bpb(results: Results) -> Figure:
    """Bits per byte against context: the schemes as lines, rope's scaling variants as points."""
    train = results.train_context
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme in results.schemes:
        xs, ys = series(results.quality.get(scheme, {}))
        ax.plot([x * train for x in xs], ys, label=scheme, **style(scheme).kwargs())
        for model in results.models_of(scheme)[1:]:  # further training seeds: thin lines in its colour
            xs, ys = series(results.quality.get(model, {}))
            ax.plot([x * train for x in xs], ys, linewidth=0.6, alpha=0.5, color=style(scheme).color)
    seeded = {model for scheme in results.schemes for model in results.models_of(scheme)}
    for name, data in results.quality.items():
        if name not in seeded:  # scaling variants (rope-ntk-x4, ...)
            xs, ys = series(data)
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


def figure_latency(schemes: list[str], data: dict[str, ByLength], name: str, xlabel: str) -> Figure:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme in schemes:
        xs, ys = series(data.get(scheme, {}))
        ax.plot(xs, [y * 1000 for y in ys], label=scheme, **style(scheme).kwargs())
    ax.set(xscale="log", xlabel=xlabel, ylabel="milliseconds (median)", title=PLOTS[name])
    ax.legend(fontsize=8)
    return fig


def figure_throughput(results: Results) -> Figure:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme in results.schemes:
        load = results.load.get(scheme, {})
        users = sorted(load, key=int)
        ax.plot([int(u) for u in users], [load[u]["tokens_per_s"] for u in users], label=scheme,
                **style(scheme).kwargs())  # fmt: skip
    ax.set(xlabel="concurrent users", ylabel="generated tokens/s", title=PLOTS["throughput_vs_concurrency.png"])
    ax.legend(fontsize=8)
    return fig


def figure_retrieval(results: Results) -> Figure:
    train = results.train_context
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    panels: tuple[tuple[Probe, str, str], ...] = (
        ("copy", "filler between the two copies (bytes)", "share of the copy predicted"),
        ("passkey", "context length (bytes)", "share of the key's digits predicted"),
        ("natural", "distance to the n-gram's previous occurrence (bytes, bucket edge)", "bits per byte"),
    )
    for ax, (probe, xlabel, ylabel) in zip(axes, panels, strict=True):
        for index, scheme in enumerate(results.schemes):
            xs, values, below, above = error_bars(results.probe(scheme, probe))
            shift = 1 + (index - len(results.schemes) / 2) * 0.03  # side by side on a log axis
            ax.errorbar([x * shift for x in xs], values, yerr=[below, above], capsize=2, label=scheme,
                        **style(scheme).kwargs())  # fmt: skip
        ax.axvline(train, color=REFERENCE, linestyle=":", label="training context")
        ax.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title=probe)
        ticks = sorted({float(k) for c in results.retrieval.values() for k in c.get(probe, {}) if k != "all"})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
        ax.minorticks_off()
        if probe != "natural":
            ax.set_ylim(-0.02, 1.02)
    axes[0].legend(fontsize=7)
    fig.suptitle(PLOTS["retrieval.png"])
    return fig


def figure_retrieval_depth(results: Results) -> Figure:
    schemes = [s for s in results.schemes if results.copy_depth(s)]  # a rerun may have measured only some
    columns = min(3, max(1, len(schemes)))
    rows = -(-len(schemes) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.4 * rows), squeeze=False, layout="constrained")
    image = None
    for ax, scheme in zip(axes.flat, schemes, strict=False):
        grid = results.copy_depth(scheme)
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


def figure_goodput(results: Results) -> Figure:
    """Goodput (solid: admit everything; dashed: --ttft-slo-seconds) and refusals per second."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for scheme in results.schemes:
        lines: tuple[tuple[dict[str, dict[str, LoadFigures]], str, str], ...] = (
            (results.load, "-", scheme), (results.load_admission, "--", f"{scheme}, admission"),
        )  # fmt: skip
        for data, line, label in lines:
            load = data.get(scheme, {})
            users = sorted(load, key=int)
            axes[0].plot([int(u) for u in users], [load[u]["goodput_per_s"] for u in users], line, label=label,
                         **style(scheme).kwargs())  # fmt: skip
            if data is results.load_admission:
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


def figure_emergence(training: dict[str, TrainingCurve]) -> Figure:
    """Copy accuracy at each probed distance and validation bpb against training tokens, one line per
    scheme; the copying bar, each scheme's first copying point (dotted) and the cap where one never copies."""
    panels = len(emergence.DISTANCES) + 1
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.2))
    for scheme, entry in training.items():
        # A log from before tokens were logged has points without them.
        counted = [(t, p) for p in entry["points"] if (t := p["tokens"]) is not None]
        if not counted:
            continue
        tokens = [t / 1e6 for t, _ in counted]
        points = [p for _, p in counted]
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


def figures(results: Results) -> dict[str, Figure]:
    """Every figure the results allow, by file name (built, not saved: tests inspect them)."""
    builders: dict[str, Callable[[], Figure]] = {
        "bpb_vs_context.png": lambda: figure_bpb(results),
        "itl_vs_context.png": lambda: figure_latency(
            results.schemes, results.itl, "itl_vs_context.png", "context length (bytes)"
        ),
        "ttft_vs_prompt.png": lambda: figure_latency(
            results.schemes, results.ttft, "ttft_vs_prompt.png", "prompt length (bytes)"
        ),
        "throughput_vs_concurrency.png": lambda: figure_throughput(results),
    }
    if results.retrieval:
        builders["retrieval.png"] = lambda: figure_retrieval(results)
        builders["retrieval_depth.png"] = lambda: figure_retrieval_depth(results)
    if results.load_admission:
        builders["goodput_vs_users.png"] = lambda: figure_goodput(results)
    if results.training:
        builders["copy_emergence.png"] = lambda: figure_emergence(results.training)
    if results.cache_budget:
        builders["kv_bytes.png"] = lambda: figure_kv_bytes(results)
        builders["cache_budget.png"] = lambda: figure_cache_budget(results)
    if results.reuse:
        builders["reuse.png"] = lambda: figure_reuse(results)
        builders["reuse_repair.png"] = lambda: figure_repair_curve(results)
    return {name: build() for name, build in builders.items()}


def plot(results: Results, out: Path) -> None:
    for name, fig in figures(results).items():
        if not fig.get_layout_engine():
            fig.tight_layout()
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
