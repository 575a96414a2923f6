"""What the report concludes from the figures: pooled and farthest probe cells, the goodput goals,
each scheme's verdict, and which cache policy keeps quality for the fewest KV bytes. Pure
functions of the results, no plotting."""

from __future__ import annotations

from dataclasses import dataclass

from contract.cache_policy import FULL, INT8, INT8_CHANNEL, parse_cache_policy
from loadtest.probes import wilson
from loadtest.study.cache_budget import policy_budget
from loadtest.study.results import ByLength, CacheBudget, Cell, Cells, LoadFigures, Results
from loadtest.study.rounds import Spread

GOODPUT_RATIO_GOAL = 0.8  # issue 22: goodput at the most users over the best at fewer, with admission
REFUSALS_PER_GOOD_GOAL = 3.0  # issue 22: refusals/s at the most users over goodput/s there
WITHIN = 0.05  # quality kept: bits per byte at most 5% above the full cache's on the same texts


def chance_fraction(chance: float) -> str:
    """A span character's chance as the report states it ("1/62")."""
    return f"1/{round(1 / chance)}"


# ---------------------------------------------------------------------------------- load


def refusals_per_good(load: LoadFigures) -> float | None:
    """Refusals per second over goodput per second at one load (None without goodput)."""
    good = load.get("goodput_per_s")
    return load.get("refused_per_s", 0.0) / good if good else None


def load_spreads(results: Results, series: str, users: str, key: str) -> dict[str, Spread]:
    """Each scheme's rounds of one load figure at one level (`series`: "load" or "load_admission");
    empty for a run measured before rounds."""
    rounds = results.load_rounds.get(series, {})
    return {
        scheme: Spread.of([figures[key] for figures in rounds[scheme][users]])
        for scheme in results.schemes
        if rounds.get(scheme, {}).get(users)
    }


def latency_spreads(results: Results, name: str, length: str) -> dict[str, Spread]:
    """Each scheme's rounds of time to first token (`name` "ttft") or inter-token latency ("itl") at one
    prompt or context length; empty for a run measured before rounds were kept."""
    rounds = results.latency_rounds.get(name, {})
    return {s: Spread.of(rounds[s][length]) for s in results.schemes if rounds.get(s, {}).get(length)}


def goodput_ratio(load: dict[str, LoadFigures]) -> float | None:
    users = sorted(load, key=int)
    if len(users) < 2:
        return None
    best = max(load[u]["goodput_per_s"] for u in users[:-1])
    return load[users[-1]]["goodput_per_s"] / best if best else None


# ---------------------------------------------------------------------------------- retrieval


def pooled(cells: Cells, up_to: int) -> Cell | None:
    """The copy cells at distances <= `up_to` bytes taken together (their trials pooled)."""
    chosen = [c for k, c in cells.items() if k != "all" and int(k) <= up_to and c is not None]
    n = sum(int(c["n"]) for c in chosen)
    if not n:
        return None
    return wilson(sum(c["value"] * c["n"] for c in chosen) / n, n).as_dict()


def largest(cells: Cells) -> Cell | None:
    """The cell at the longest length (None if the model cannot take it)."""
    keys = sorted((k for k in cells if k != "all"), key=int)
    return cells[keys[-1]] if keys else None


def verdict(quality: dict[float, float], near: Cell | None, far: Cell | None, chance: float) -> str:
    """Whether bits per byte extrapolate and copying reaches far (above `chance`, a span
    character's), and whether the two agree (the rules are stated under the report's table)."""
    longest = max(quality, default=None)
    base = quality.get(1.0)
    extrapolates = base is not None and longest is not None and longest > 1 and quality[longest] <= 1.15 * base
    copies = near is not None and near["low"] > chance
    retrieves = (
        copies and far is not None and near is not None and far["value"] >= 0.5 * near["value"] and far["low"] > chance
    )
    if far is None or longest is None or longest <= 1:
        return "bounded: cannot take contexts past its positions"
    if extrapolates and not retrieves:
        return "disagree: bits per byte extrapolate, far retrieval does not"
    if retrieves and not extrapolates:
        return "disagree: retrieves far, but bits per byte degrade past the training context"
    if retrieves:
        return "agree: extrapolates and retrieves far"
    return "agree: neither extrapolates nor retrieves far" + ("" if copies else " (does not copy at all)")


# ---------------------------------------------------------------------------------- cache budgets


def policy_tokens(policy: str, full_tokens: int) -> int:
    """Tokens a policy's cache holds for a text of `full_tokens` (full: all of them)."""
    budget = policy_budget(policy)
    return full_tokens if budget is None else min(budget, full_tokens)


def bpb_cell(value: float | Cell | None) -> float | None:
    """An int8 table's bits-per-byte entry (its probe entries, "copy@D", are cells)."""
    return None if isinstance(value, dict) else value


def probe_cell(value: float | Cell | None) -> Cell | None:
    """An int8 table's probe entry ("copy@D")."""
    return value if isinstance(value, dict) else None


def measured_bpb(figures: CacheBudget) -> dict[str, ByLength]:
    """One scheme's bits per byte by policy and multiple of the training context: the bpb tables
    and the int8 table (its `full` row, fp32 at the int8 table's lengths, joins `full`)."""
    merged = {policy: dict(cells) for policy, cells in figures["bpb"].items()}
    for policy, cells in figures.get("int8", {}).items():
        merged.setdefault(policy, {}).update({k: bpb_cell(v) for k, v in cells.items() if "@" not in k})
    return merged


def bpb_multiples(data: dict[str, CacheBudget]) -> list[str]:
    """Every multiple of the training context any scheme's bits per byte were measured at."""
    return sorted({m for f in data.values() for cells in measured_bpb(f).values() for m in cells}, key=float)


@dataclass(frozen=True)
class Int8Ratio:
    """int8 K/V bytes over float32's per token, from the allocations measured: `int8` rows (fixed
    per-channel scales) and bounded `+int8` rows (their int8 values plus per-token scales)."""

    unbounded: float
    bounded: float

    def of(self, kind: str) -> float:
        """Of a storage kind (storage_kind): int8 rows' of their kind, float rows' 1."""
        return {INT8_CHANNEL: self.unbounded, INT8: self.bounded}.get(kind, 1.0)


def storage_kind(policy: str) -> str:
    """How a policy stores its rows (CachePolicy.kind), on the reference machine's float32 CPU engine,
    which reads unbounded int8 rows with per-channel scales."""
    return parse_cache_policy(policy).kind(FLOAT32, channel_scales=True)


FLOAT32 = "float32"


def int8_ratio(data: dict[str, CacheBudget]) -> Int8Ratio | None:
    """The measured int8 / float32 allocation ratios (the same tokens in the same capacity classes):
    `int8` against `full`, and a bounded `W+int8` against `W` where both were measured (else the
    unbounded ratio)."""
    unbounded = bounded = None
    for figures in data.values():
        cost = figures["cost"]
        full, quantized = cost.get("full"), cost.get("int8")
        if unbounded is None and full and quantized:
            unbounded = float(quantized["kv_physical_bytes"] / full["kv_physical_bytes"])
        for policy, figure in cost.items():
            base = cost.get(policy.removesuffix("+int8"))
            if bounded is None and figure and base and storage_kind(policy) == INT8:
                bounded = float(figure["kv_physical_bytes"] / base["kv_physical_bytes"])
    if unbounded is None:
        return None
    return Int8Ratio(unbounded, unbounded if bounded is None else bounded)


def sequence_bytes(policy: str, tokens: int, bytes_per_token: float, ratio: Int8Ratio | None) -> float:
    """KV bytes one sequence of `tokens` tokens holds under `policy` (the tokens it keeps, whole)."""
    per_token = bytes_per_token * (ratio.of(storage_kind(policy)) if ratio else 1.0)
    return parse_cache_policy(policy).cached(tokens) * per_token


def in_panel(policy: str, kind: str | None) -> bool:
    """Unbounded policies (full, int8) belong to every panel; a bounded one to its own form's."""
    return kind is None or parse_cache_policy(policy).keeps in (FULL, kind)


def cheapest_within(
    figures: CacheBudget | None, multiple: str, train: int, ratio: Int8Ratio | None, kind: str | None = None
) -> tuple[str, float, float] | None:
    """The policy keeping the fewest KV bytes whose bits per byte at `multiple` stay within WITHIN of
    the full cache's: (policy, bytes per sequence, bpb change); None where the full cache is not
    servable (or the scheme was not measured). Ties go to the first measured (full before the
    bounded policies)."""
    if figures is None:
        return None
    bpb = measured_bpb(figures)
    full = bpb.get("full", {}).get(multiple)
    if full is None:
        return None
    tokens = round(float(multiple) * train)
    candidates = [
        (sequence_bytes(policy, tokens, figures["bytes_per_token"], ratio), policy, value / full - 1)
        for policy, cells in bpb.items()
        if (value := cells.get(multiple)) is not None
        and value <= full * (1 + WITHIN)
        and in_panel(policy, kind)
        and (ratio or storage_kind(policy) == FLOAT32)
    ]
    nbytes, policy, change = min(candidates, key=lambda c: c[0])
    return policy, nbytes, change
