"""One colour and one marker per positional scheme, for every figure of the report and the Grafana
dashboard's series, so a reader comparing figures never meets the same scheme in two colours.

Standard library only (the dashboard test and tools without matplotlib import it). Colours are
Okabe and Ito's colour-blind-safe set (https://jfly.uni-koeln.de/color/); rope's scaling variants
(`rope-ntk-x4`, as export/repository.py names them) are shades of rope's colour, lighter for a
smaller factor, with one marker per scaling method. `python -m loadtest.palette` writes the
series overrides into deploy/grafana/dashboards/posenc-serve.json; a test keeps the two in step.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.names import SEED_MARK
from contract.paths import REPOSITORY_ROOT


@dataclass(frozen=True)
class Style:
    color: str  # "#rrggbb"
    marker: str  # a matplotlib marker

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of a matplotlib plot/scatter/errorbar call."""
        return {"color": self.color, "marker": self.marker}


# The schemes in models.positional.SCHEMES order (a test checks the keys against it): Okabe-Ito's
# colour-blind-safe hues, then two more for the hybrids and one for latent attention.
SCHEMES: dict[str, Style] = {
    "sinusoidal": Style("#e69f00", "s"),  # orange
    "learned": Style("#56b4e9", "^"),  # sky blue
    "relative": Style("#009e73", "D"),  # bluish green
    "rope": Style("#cc79a7", "o"),  # reddish purple: its shades (variants) meet no other scheme's hue
    "alibi": Style("#0072b2", "v"),  # blue
    "none": Style("#d55e00", "P"),  # vermillion
    "rnope-swa": Style("#000000", "X"),  # black
    "rope-swa": Style("#8c564b", "h"),  # brown
    "mla": Style("#bcbd22", "p"),  # olive
}
# A scaled variant's marker, by scaling method (models.config.RopeScaling kinds).
METHOD_MARKERS = {"linear": "<", "ntk": ">", "yarn": "*"}
SCALED = ("rope",)  # the schemes exported with inference-time scaling variants
VARIANT_FACTORS = (2, 4, 8)  # the factors loadtest.compare exports; any other factor is shaded as well
_VARIANT = re.compile(r"(?P<base>[a-z]+)-(?P<method>[a-z]+)-x(?P<factor>[0-9.]+)")

# Not schemes: reference lines (the training context), heat maps and the text written on them, and
# the cache-policy lines of the memory figure.
REFERENCE = "#555555"
HEATMAP = "viridis"  # a matplotlib colormap: perceptually uniform, readable in grey
TEXT_ON_DARK, TEXT_ON_LIGHT = "#ffffff", "#000000"
# Cache-policy lines: unbounded (full, int8) black, bounded budgets in greys darker for more
# tokens (smallest first), int8 dashed.
UNBOUNDED = "#000000"
BUDGET_SHADES = ("#b0b0b0", "#858585", "#5a5a5a")
POLICY_LINESTYLES = {False: "-", True: "--"}  # by int8


def _mix(color: str, toward: str, amount: float) -> str:
    """`color` moved `amount` (0..1) of the way to `toward`, both "#rrggbb"."""
    a = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    b = [int(toward[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * amount):02x}" for x, y in zip(a, b, strict=True))


def shade(color: str, factor: float) -> str:
    """A variant's shade of its base colour: x2 lighter, x4 darker, x8 and beyond darker still."""
    lightness = 0.45 - 0.65 * math.log2(factor / 2)  # x2: +0.45 (toward white), x4: -0.20 (toward black)
    lightness = max(-0.55, min(0.6, lightness))
    return _mix(color, "#ffffff", lightness) if lightness >= 0 else _mix(color, "#000000", -lightness)


def style(name: str) -> Style:
    """The style of a scheme, of a scaled variant (`rope-yarn-x8`) or of a further training seed of a
    scheme (`rope@seed2`: the scheme's own, a seed is the same scheme); KeyError for anything else,
    so no series is drawn in a colour the palette does not define."""
    name = name.partition(SEED_MARK)[0]
    if name in SCHEMES:
        return SCHEMES[name]
    match = _VARIANT.fullmatch(name)
    if match is None or match["base"] not in SCHEMES or match["method"] not in METHOD_MARKERS:
        raise KeyError(f"{name!r}: not a scheme ({', '.join(SCHEMES)}) or a scaled variant of one")
    base = SCHEMES[match["base"]]
    return Style(shade(base.color, float(match["factor"])), METHOD_MARKERS[match["method"]])


def policy_style(int8: bool, rank: int | None = None) -> dict[str, str]:
    """matplotlib keywords of a cache-policy line: black unbounded (rank None), else the grey of its
    budget's rank among the figure's budgets (0: smallest); dashed for int8."""
    color = UNBOUNDED if rank is None else BUDGET_SHADES[min(rank, len(BUDGET_SHADES) - 1)]
    return {"color": color, "linestyle": POLICY_LINESTYLES[int8]}


# ---------------------------------------------------------------------------------------- Grafana

DASHBOARD = REPOSITORY_ROOT / "deploy" / "grafana" / "dashboards" / "posenc-serve.json"


def _override(pattern: str, color: str) -> dict[str, object]:
    return {
        "matcher": {"id": "byRegexp", "options": pattern},
        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}],
    }


def grafana_overrides() -> list[dict[str, object]]:
    """Series overrides for panels whose legends start with the model (`{{model}} p95`): each
    scheme's colour, then its variants' shades (Grafana applies later overrides over earlier ones).
    Grafana draws no per-series marker shapes, so the dashboard carries the colours only."""
    variants = [f"{base}-{method}-x{n}" for base in SCALED for method in METHOD_MARKERS for n in VARIANT_FACTORS]
    names = [*SCHEMES, *variants]
    return [_override(f"^{re.escape(name)}( .*)?$", style(name).color) for name in names]


def write_dashboard_overrides(path: Path = DASHBOARD) -> None:
    """Set every per-model panel's overrides to the palette's (panels whose legend starts with {{model}})."""
    dashboard = json.loads(path.read_text())
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            continue
        legends = [target.get("legendFormat", "") for target in panel.get("targets", [])]
        if legends and all(legend.startswith("{{model}}") for legend in legends):
            panel["fieldConfig"]["overrides"] = grafana_overrides()
    path.write_text(json.dumps(dashboard, indent=2) + "\n")


if __name__ == "__main__":
    write_dashboard_overrides()
    print(DASHBOARD)
