"""The cache-budget figures: KV bytes per sequence by policy and context, and quality against
those bytes, a panel per eviction kind (window; StreamingLLM's sinks plus window)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from contract.cache_policy import parse_cache_policy
from loadtest.palette import REFERENCE, TEXT_ON_LIGHT, policy_style, style
from loadtest.report.analysis import (
    FLOAT32,
    WITHIN,
    bpb_multiples,
    cheapest_within,
    in_panel,
    int8_ratio,
    measured_bpb,
    policy_tokens,
    sequence_bytes,
    storage_kind,
)
from loadtest.report.formatting import binary_bytes
from loadtest.report.titles import PLOTS
from loadtest.study.cache_budget import COST_HISTORY
from loadtest.study.results import Results

PANELS = (("window", "window:W (the last W tokens)"), ("sinks", "sinks:4+window:W-4 (StreamingLLM)"))


def figure_kv_bytes(results: Results) -> Figure:
    """KV bytes per sequence against context length, one line per cache policy measured (full,
    window, sinks, int8), and per scheme a marker at each measured length on the cheapest policy
    whose bits per byte stay within 5% of its full cache: the memory each scheme needs."""
    data = results.cache_budget
    train = results.train_context
    ratio = int8_ratio(data)
    per_token = next(iter(data.values()))["bytes_per_token"]
    policies = list(dict.fromkeys(p for f in data.values() for p in measured_bpb(f)))
    policies = [p for p in policies if ratio or storage_kind(p) == FLOAT32]
    budgets = sorted({b for p in policies if (b := parse_cache_policy(p).budget) is not None})
    multiples = bpb_multiples(data)
    longest = max(COST_HISTORY, round(float(multiples[-1]) * train))
    contexts = np.geomspace(min(budgets, default=train) / 2, longest * 1.1, 200)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, (kind, title) in zip(axes, PANELS, strict=True):
        for policy in (p for p in policies if in_panel(p, kind)):
            parsed = parse_cache_policy(policy)
            rank = None if parsed.budget is None else budgets.index(parsed.budget)
            xs = [t for t in contexts if t >= (parsed.budget or 0)]  # below its budget a policy is its full form
            ys = [sequence_bytes(policy, round(t), per_token, ratio) for t in xs]
            ax.plot(xs, ys, label=policy, linewidth=1.2, **policy_style(storage_kind(policy) != FLOAT32, rank))
        allocated = [
            (sequence_bytes(policy, COST_HISTORY, per_token, ratio), cost["kv_physical_bytes"])
            for policy in policies
            if in_panel(policy, kind)
            for cost in [next((f["cost"].get(policy) for f in data.values() if f["cost"].get(policy)), None)]
            if cost
        ]
        if allocated:
            ax.scatter([COST_HISTORY] * len(allocated), [a for _, a in allocated], marker="_", s=120,
                       color=REFERENCE, label=f"allocated at {COST_HISTORY} tokens (measured)")  # fmt: skip
        for index, scheme in enumerate(results.schemes):
            shift = 1 + (index - len(results.schemes) / 2) * 0.05  # side by side on a log axis
            points = [
                (float(m) * train * shift, chosen[1])
                for m in multiples
                if (chosen := cheapest_within(data.get(scheme), m, train, ratio, kind)) is not None
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
    axes[0].set_yticks(yticks, [binary_bytes(v) for v in yticks])
    axes[0].set_ylabel("KV bytes per sequence")
    fig.suptitle(
        f"{PLOTS['kv_bytes.png']}: markers, each scheme's cheapest policy whose bits per byte stay within "
        f"{WITHIN:.0%} of its full cache at that length",
        fontsize=10,
    )
    return fig


def figure_cache_budget(results: Results) -> Figure:
    """bpb at the longest text against KV bytes per sequence, one line per scheme, a panel per eviction kind."""
    data = results.cache_budget
    train = results.train_context
    longest = max(float(m) for c in data.values() for m in next(iter(c["bpb"].values())))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for ax, (kind, title) in zip(axes, PANELS, strict=True):
        for scheme, figures in data.items():
            points = []
            for policy, cells in figures["bpb"].items():
                value = cells.get(f"{longest:g}")
                if value is None or not (policy == "full" or policy.startswith(kind)):
                    continue
                tokens = policy_tokens(policy, int(longest * train))
                points.append((tokens * figures["bytes_per_token"], value))
            if points:
                points.sort()
                ax.plot([p[0] / 1e6 for p in points], [p[1] for p in points], label=scheme, **style(scheme).kwargs())
        ax.set(xscale="log", xlabel="KV bytes per sequence (tokens kept; rightmost: the full cache)", title=title)
        per_token = next(iter(data.values()))["bytes_per_token"]
        kept = sorted({policy_tokens(p, int(longest * train)) for f in data.values() for p in f["bpb"]})
        ax.set_xticks([t * per_token / 1e6 for t in kept], [f"{t * per_token / 1e6:.2f} MB\n({t})" for t in kept])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"bits per byte at {longest:g}x the training context")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        PLOTS["cache_budget.png"] + f" ({longest * train:.0f}-byte held-out texts, streamed through the cache)"
    )
    return fig
