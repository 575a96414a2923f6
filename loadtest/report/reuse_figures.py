"""The `reuse` section's figure: the shared prefix's TTFT and goodput with and without the prefix
cache, and the documents' answer bits per byte under each reuse mode against the full recompute."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from loadtest.palette import REFERENCE, style
from loadtest.report.reuse_tables import (
    REUSE_WITHIN,
    bpb_change,
    mode_changes,
    mode_name,
    repair_k,
    repairs_of,
    seeds_of,
    served_reuse,
)
from loadtest.report.titles import PLOTS
from loadtest.study.results import Results

REUSE_MODES = ("as_is", "rotate")  # then the repairs, in order of k


def figure_reuse(results: Results) -> Figure:
    """Top: TTFT p50 and goodput against users (solid: the prefix cache; dashed: without). Bottom, per
    form: the answer's bpb change from the full recompute, one bar per scheme and mode."""
    served = {s: results.reuse[s] for s in results.schemes if "shared_prefix" in results.reuse.get(s, {})}
    forms = sorted({f for r in served.values() for f in r["documents"]}, key=["short", "long"].index)
    fig, axes = plt.subplots(2, max(2, len(forms)), figsize=(13, 8.5), squeeze=False)
    for scheme, reuse in served.items():
        shared = reuse["shared_prefix"]
        for data, line, label in ((shared["cache"], "-", scheme), (shared["no_cache"], "--", f"{scheme}, no cache")):
            users = sorted(data, key=int)
            xs = [int(u) for u in users]
            axes[0][0].plot(xs, [data[u]["ttft_p50_s"] * 1000 for u in users], line, label=label,
                            **style(scheme).kwargs())  # fmt: skip
            axes[0][1].plot(xs, [data[u]["goodput_per_s"] for u in users], line, label=label,
                            **style(scheme).kwargs())  # fmt: skip
    axes[0][0].set(xlabel="concurrent users", ylabel="TTFT p50 (ms)", yscale="log", title="Shared prefix: TTFT")
    axes[0][1].set(xlabel="concurrent users", ylabel="goodput (requests/s within targets)",
                   title="Shared prefix: goodput, admission control on")  # fmt: skip
    axes[0][1].legend(fontsize=6, ncol=2)
    ticks = sorted({int(u) for r in served.values() for u in r["shared_prefix"]["cache"]})
    for ax in axes[0][:2]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    for ax in axes[0][2:]:
        ax.axis("off")
    for ax, form in zip(axes[1], forms, strict=False):
        schemes = [s for s in results.schemes if s in results.reuse]
        measured = {m for r in served.values() for m in r["documents"].get(form, {"modes": {}})["modes"]}
        repairs = [m for m in repairs_of(dict.fromkeys(measured)) if m != "repair:all"]
        modes = [*REUSE_MODES, *repairs]
        width = 0.8 / len(modes)
        for index, scheme in enumerate(schemes):
            figures = results.reuse[scheme]["documents"].get(form)
            if results.reuse[scheme]["segment_reuse"] == "recompute":
                ax.annotate("recompute:\nnothing reused", (index, 0), ha="center", va="bottom", fontsize=7)
            if figures is None:
                continue
            for offset, mode in enumerate(modes):
                change = bpb_change(figures["modes"].get(mode), figures["modes"].get("full"))
                if change is None:
                    continue
                naive = mode == "as_is" and results.reuse[scheme]["segment_reuse"] == "rotate"  # in-process only
                ax.bar(index + (offset - (len(modes) - 1) / 2) * width, change * 100, width, color=style(scheme).color,
                       alpha=1.0 - 0.6 * offset / len(modes), hatch="//" if naive else "")  # fmt: skip
        ax.axhline(REUSE_WITHIN * 100, color=REFERENCE, linestyle=":", label="+1%")
        ax.axhline(0, color=REFERENCE, linewidth=0.6)
        ax.set_xticks(range(len(schemes)), schemes, fontsize=8)
        ax.set_xlim(-0.6, len(schemes) - 0.4)
        ax.set(ylabel="answer bpb vs full recompute (%)",
               title=f"{form} form, bars left to right: " + ", ".join(mode_name(m) for m in modes))  # fmt: skip
        ax.title.set_fontsize(8)
    fig.suptitle(PLOTS["reuse.png"])
    return fig


def figure_repair_curve(results: Results) -> Figure:
    """Per form: the answer's bpb change from the full recompute against the repair's k (0: as placed;
    the whole document last; the sink-kept precompute apart at the right), one line per scheme, solid
    for the served prompt sample and dashed for the others, with the paired 95% intervals."""
    reusing = {s: r for s, r in served_reuse(results).items() if r["segment_reuse"] != "recompute"}
    forms = sorted({f for r in reusing.values() for f in r["documents"]}, key=["short", "long"].index)
    fig, axes = plt.subplots(1, max(1, len(forms)), figsize=(6.5 * max(1, len(forms)), 4.8), squeeze=False)
    for ax, form in zip(axes[0], forms, strict=False):
        columns = sorted({m for r in reusing.values() for seed in seeds_of(r)
                          for m in repairs_of(mode_changes(r, form, seed) or {})}, key=repair_k)  # fmt: skip
        labels = ["0", *("whole" if m == "repair:all" else str(repair_k(m)) for m in columns), "sink"]
        for scheme, reuse in reusing.items():
            for index, seed in enumerate(seeds_of(reuse)):
                changes = mode_changes(reuse, form, seed)
                if changes is None:
                    continue
                points = [(x, changes.get(m)) for x, m in enumerate([reuse["segment_reuse"], *columns])]
                xs = [x + 0.06 * index for x, c in points if c is not None]
                cells = [c for _, c in points if c is not None]
                values = [c["value"] * 100 for c in cells]
                errors = [[(c["value"] - c["low"]) * 100 for c in cells],
                          [(c["high"] - c["value"]) * 100 for c in cells]]  # fmt: skip
                label = f"{scheme}, prompt seed {seed}"
                ax.errorbar(xs, values, yerr=errors, linestyle="-" if index == 0 else "--", capsize=2, label=label,
                            color=style(scheme).color, marker=style(scheme).marker, markersize=3)  # fmt: skip
                sink = changes.get("sink")
                if sink is not None:
                    ax.errorbar([len(columns) + 1 + 0.06 * index], [sink["value"] * 100],
                                yerr=[[(sink["value"] - sink["low"]) * 100], [(sink["high"] - sink["value"]) * 100]],
                                color=style(scheme).color, marker="s", capsize=2)  # fmt: skip
        ax.axhspan(-REUSE_WITHIN * 100, REUSE_WITHIN * 100, color=REFERENCE, alpha=0.15, label="within +-1%")
        ax.axhline(0, color=REFERENCE, linewidth=0.6)
        ax.set_xticks(range(len(labels)), labels)
        ax.set(xlabel="repaired tokens per document, k (then the sink-kept precompute)",
               ylabel="answer bpb vs full recompute (%)", title=f"{form} form")  # fmt: skip
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(PLOTS["reuse_repair.png"])
    return fig
