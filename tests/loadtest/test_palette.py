"""One palette: every figure of the report draws each scheme in the colour and marker that
loadtest/palette.py defines, no plotting call names a colour of its own, and the memory figure
answers what a cache policy saves."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import matplotlib

from contract.names import seed_model_name
from contract.paths import REPOSITORY_ROOT

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
from matplotlib.collections import PathCollection
from matplotlib.colors import to_hex
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure

from loadtest import palette
from loadtest.report.analysis import WITHIN, cheapest_within, int8_ratio, sequence_bytes
from loadtest.report.figures import figures
from loadtest.study.results import Results
from models.positional import SCHEMES

REFERENCE_RESULTS = REPOSITORY_ROOT / "reports" / "reference" / "results.json"
# Keywords of matplotlib calls that set a colour.
COLOR_KEYWORDS = {"color", "colors", "c", "facecolor", "facecolors", "edgecolor", "edgecolors", "ecolor",
                  "markerfacecolor", "markeredgecolor", "cmap", "colormap"}  # fmt: skip
# Calls that draw data series: each must take its colour from the palette.
SERIES_CALLS = {"plot", "scatter", "errorbar", "bar", "barh", "fill_between", "step", "hist", "stackplot",
                "axvline", "axhline", "vlines", "hlines", "semilogx", "semilogy", "loglog"}  # fmt: skip


@pytest.fixture(scope="module")
def results() -> Results:
    return Results.read(REFERENCE_RESULTS)


@pytest.fixture(scope="module")
def drawn(results: Results) -> Iterator[dict[str, Figure]]:
    built = figures(results)
    yield built
    for fig in built.values():
        plt.close(fig)


def allowed_colours(results: Results) -> set[str]:
    names = [*results.schemes, *results.quality]
    return (
        {palette.style(name).color for name in names}
        | {palette.REFERENCE, palette.UNBOUNDED, palette.TEXT_ON_DARK, palette.TEXT_ON_LIGHT}
        | set(palette.BUDGET_SHADES)
    )


def named(label: str) -> str | None:
    """The scheme or variant a legend label names ("alibi", "alibi, admission"), if any."""
    head = label.split(",")[0]
    try:
        palette.style(head)
    except KeyError:
        return None
    return head


@pytest.mark.server  # runs a subprocess
def test_the_palette_covers_every_scheme_and_needs_no_matplotlib() -> None:
    assert tuple(palette.SCHEMES) == SCHEMES
    assert len({s.color for s in palette.SCHEMES.values()}) == len(SCHEMES)
    assert len({s.marker for s in palette.SCHEMES.values()}) == len(SCHEMES)
    code = "import sys; sys.modules['matplotlib'] = None; import loadtest.palette; print('ok')"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPOSITORY_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "ok"


def test_rope_variants_are_shades_of_rope_and_unknown_names_are_refused() -> None:
    rope = palette.style("rope").color
    shades = {palette.style(f"rope-{m}-x{f}").color for m in palette.METHOD_MARKERS for f in (2, 4, 8)}
    assert len(shades) == 3 and rope not in shades  # one shade per factor, none rope's own
    for shade in shades:  # the same hue: each channel moved the same share toward white or black
        moved = [(int(shade[i : i + 2], 16), int(rope[i : i + 2], 16)) for i in (1, 3, 5)]
        shares = {round((s - r) / ((255 if s >= r else 0) - r), 2) for s, r in moved if (255 if s >= r else 0) != r}
        assert len(shares) == 1, (shade, shares)
    assert {palette.style(f"rope-{m}-x4").marker for m in palette.METHOD_MARKERS} == set(
        palette.METHOD_MARKERS.values()
    )
    with pytest.raises(KeyError):
        palette.style("rope-unknown-x4")
    with pytest.raises(KeyError):
        palette.style("mystery")


def test_every_series_of_every_figure_takes_the_palette_s_colour_and_marker(
    results: Results,
    drawn: dict[str, Figure],
) -> None:
    """Rendered on the reference results.json with the Agg backend: each line, point set and error
    bar naming a scheme or variant has its palette colour (and marker), and nothing is drawn in a
    colour outside the palette."""
    allowed = allowed_colours(results)
    seen: dict[str, set[str]] = {}
    for name, fig in drawn.items():
        for ax in fig.axes:
            for line in ax.lines:
                colour = to_hex(line.get_color())
                assert colour in allowed, (name, line.get_label(), colour)
                if scheme := named(str(line.get_label())):
                    assert colour == palette.style(scheme).color, (name, scheme, colour)
                    assert line.get_marker() == palette.style(scheme).marker, (name, scheme)
                    seen.setdefault(name, set()).add(scheme)
            for collection in ax.collections:
                if collection.get_array() is not None:  # coloured by a colormap (the colour bar): HEATMAP
                    continue
                colours = {to_hex(c) for c in [*collection.get_facecolors(), *collection.get_edgecolors()]}
                assert colours <= allowed, (name, collection.get_label(), colours)
                if isinstance(collection, PathCollection) and (scheme := named(str(collection.get_label()))):
                    assert colours == {palette.style(scheme).color}, (name, scheme, colours)
                    seen.setdefault(name, set()).add(scheme)
            for container in ax.containers:
                if isinstance(container, ErrorbarContainer) and (scheme := named(str(container.get_label()))):
                    data_line = container.lines[0]
                    assert data_line is not None
                    assert to_hex(data_line.get_color()) == palette.style(scheme).color, (name, scheme)
                    assert data_line.get_marker() == palette.style(scheme).marker, (name, scheme)
                    seen.setdefault(name, set()).add(scheme)
    per_scheme = {"bpb_vs_context.png", "itl_vs_context.png", "ttft_vs_prompt.png", "throughput_vs_concurrency.png",
                  "goodput_vs_users.png", "retrieval.png", "kv_bytes.png"}  # fmt: skip
    for name in per_scheme:
        assert seen[name] >= set(results.schemes), (name, seen.get(name))
    seeds = {seed_model_name(s, seed) for s in results.schemes for seed in results.seeds.get(s, [])[1:]}
    assert seen["bpb_vs_context.png"] == set(results.quality) - seeds  # the rope variants too, not the seeds
    assert seen["cache_budget.png"] >= {"alibi", "rope", "relative", "none", "sinusoidal"}  # learned: no 8x text


def _plotting_modules() -> list[Path]:
    """Every Python file of the repository that imports matplotlib, the palette excepted."""
    skip = {REPOSITORY_ROOT / ".venv", REPOSITORY_ROOT / "loadtest" / "palette.py"}
    found = []
    for path in REPOSITORY_ROOT.rglob("*.py"):
        if any(path == s or s in path.parents for s in skip) or any(p.startswith(".") for p in path.parts):
            continue
        if "matplotlib" in path.read_text():
            found.append(path)
    return found


def test_no_plotting_call_names_a_colour_of_its_own() -> None:
    """AST check: no call in a plotting module passes a literal colour (or colormap), and every
    series-drawing call passes a colour: a palette name or a palette function's keywords."""
    modules = _plotting_modules()
    assert REPOSITORY_ROOT / "loadtest" / "report" / "figures.py" in modules
    problems = []
    for path in modules:
        if path.is_relative_to(REPOSITORY_ROOT / "tests"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            where = f"{path.relative_to(REPOSITORY_ROOT)}:{node.lineno}"
            for keyword in node.keywords:
                if keyword.arg in COLOR_KEYWORDS and any(
                    isinstance(n, ast.Constant) and isinstance(n.value, str) for n in ast.walk(keyword.value)
                ):
                    problems.append(f"{where}: literal {keyword.arg}")
            if isinstance(node.func, ast.Attribute) and node.func.attr in SERIES_CALLS:
                takes_colour = any(k.arg in COLOR_KEYWORDS or k.arg is None for k in node.keywords)
                if not takes_colour:
                    problems.append(f"{where}: {node.func.attr}() without a palette colour")
                formats = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                problems += [f"{where}: format {f!r} names a colour" for f in formats if set(f) & set("bgrcmykwC")]
    assert not problems, problems


def test_memory_figure_answers_what_each_policy_keeps(
    results: Results,
    drawn: dict[str, Figure],
) -> None:
    data, train = results.cache_budget, 256
    ratio = int8_ratio(data)
    assert ratio is not None and ratio.unbounded == 0.25  # int8 values, the scales being the model's
    assert 0.25 < ratio.bounded < 0.3  # int8 values plus a float32 scale per head and token
    assert sequence_bytes("window:64", 2048, 4096, ratio) == 64 * 4096
    assert sequence_bytes("sinks:4+window:60", 32, 4096, ratio) == 32 * 4096
    assert sequence_bytes("full", 2048, 4096, ratio) == 2048 * 4096
    assert sequence_bytes("int8", 2048, 4096, ratio) == 2048 * 1024
    assert sequence_bytes("window:256+int8", 2048, 4096, ratio) == pytest.approx(256 * 4096 * ratio.bounded)
    # ALiBi at 8x: only 4 sinks and a 252-token window keep bits per byte within 5% of the full
    # cache (window:256 alone costs 6.1%): 256 tokens.
    policy, nbytes, change = cheapest_within(data["alibi"], "8", train, ratio)  # type: ignore[misc]
    assert policy == "sinks:4+window:252" and nbytes == 256 * 4096 and 0 < change <= WITHIN
    assert cheapest_within(data["learned"], "2", train, ratio) is None  # past its table: not servable
    for scheme, figures_ in data.items():  # the chosen policy is never worse than the bound
        for m in ("2", "4", "8"):
            chosen = cheapest_within(figures_, m, train, ratio)
            assert chosen is None or chosen[2] <= WITHIN, (scheme, m, chosen)
    fig = drawn["kv_bytes.png"]
    window, sinks = fig.axes[:2]
    labels = {str(line.get_label()) for line in window.lines}
    assert {"full", "int8", "window:64", "window:128", "window:256", "window:256+int8"} <= labels
    assert not any(label.startswith("sinks") for label in labels)
    assert {"sinks:4+window:60", "sinks:4+window:252", "full"} <= {str(line.get_label()) for line in sinks.lines}
    # The marker drawn for ALiBi at 2048 tokens sits on the sinks:4+window:252 line.
    (alibi,) = [line for line in sinks.lines if line.get_label() == "alibi"]
    points = dict(zip(alibi.get_xdata(), alibi.get_ydata(), strict=True))
    assert points[max(points)] == 256 * 4096
