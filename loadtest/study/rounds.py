"""Figures measured over rounds: the median a table shows, the min-max range beside it, and the rule
that two schemes' figures differ only where their ranges do not overlap ("within noise" otherwise).

A shared 2-core machine's speed drifts by a quarter over minutes, so one sample per level cannot
tell a scheme's cost from the machine's mood: the timed sections measure every level in rounds
(schemes rotated each round, loadtest/study/timed.py) and keep each round's figures.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.study.results import LoadFigures


@dataclass(frozen=True)
class Spread:
    """A figure's rounds: their median, lowest and highest."""

    median: float
    low: float
    high: float
    rounds: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one round")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def overlaps(self, other: Spread) -> bool:
        """Whether the two ranges share a value: the difference of the medians is within noise."""
        return self.low <= other.high and other.low <= self.high

    def text(self, digits: int = 2, scale: float = 1.0) -> str:
        """`median [low-high]`, or the median alone from one round."""
        median = f"{self.median * scale:.{digits}f}"
        if self.rounds < 2:
            return median
        return f"{median} [{self.low * scale:.{digits}f}-{self.high * scale:.{digits}f}]"


def median_figures(rounds: Sequence[LoadFigures]) -> LoadFigures:
    """One load level's figures over its rounds: each figure's median (counts too, so a table reads
    one typical round), except the KV peak, the most any round held."""
    if not rounds:
        raise ValueError("no rounds to take the median of")
    out = {key: float(statistics.median(r[key] for r in rounds)) for key in rounds[0]}
    if "kv_peak_bytes" in out:
        out["kv_peak_bytes"] = max(r["kv_peak_bytes"] for r in rounds)
    return out


def medians(by_users: dict[str, list[LoadFigures]]) -> dict[str, LoadFigures]:
    """Each level's figures over its rounds (`median_figures`)."""
    return {users: median_figures(rounds) for users, rounds in by_users.items()}


def goodput_ratio_rounds(by_users: dict[str, list[LoadFigures]]) -> tuple[float | None, Spread | None]:
    """Goodput at the most users over the best at fewer users: on the medians of the rounds (the
    figure a goal is judged on), and each round's own ratio as a spread (None: fewer than two levels,
    or nothing good at fewer users)."""
    users = sorted(by_users, key=int)
    if len(users) < 2:
        return None, None
    medians = {u: statistics.median(r["goodput_per_s"] for r in by_users[u]) for u in users}
    best = max(medians[u] for u in users[:-1])
    ratio = medians[users[-1]] / best if best else None
    rounds = min(len(by_users[u]) for u in users)
    per_round = []
    for k in range(rounds):
        best_k = max(by_users[u][k]["goodput_per_s"] for u in users[:-1])
        if best_k:
            per_round.append(by_users[users[-1]][k]["goodput_per_s"] / best_k)
    return ratio, Spread.of(per_round) if per_round else None


def compared(spreads: dict[str, Spread], higher_is_better: bool) -> dict[str, str]:
    """Each scheme's figure against the best median: "best", "within noise of <best>" where the
    ranges overlap, or "below <best>" / "above <best>" where they do not."""
    if not spreads:
        return {}
    pick = max if higher_is_better else min
    best = pick(spreads, key=lambda scheme: spreads[scheme].median)
    out = {}
    for scheme, spread in spreads.items():
        if scheme == best:
            out[scheme] = "best"
        elif spread.overlaps(spreads[best]):
            out[scheme] = f"within noise of {best}"
        else:
            out[scheme] = f"{'below' if higher_is_better else 'above'} {best}"
    return out
