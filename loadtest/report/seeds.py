"""A scheme's figures and verdicts over its training seeds (issue 55).

Each training seed of a scheme is scored under its own model name (`rope@seed2`, contract.names;
the served seed under the scheme's), in the sections that belong to the checkpoint: quality,
retrieval, cache budgets, reuse and speculation. The report gives a figure as the seeds' mean with
their range, and a verdict as holding on every seed or not: where seeds disagree it says which seed
says what, never one seed's pick. A scheme with one seed is marked as such where others have more.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from loadtest.study.results import Results


@dataclass(frozen=True)
class AcrossSeeds:
    """One figure of one scheme, a value per training seed (the served seed first)."""

    values: dict[str, float]  # seed (as the report names it) -> value

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values.values())

    @property
    def low(self) -> float:
        return min(self.values.values())

    @property
    def high(self) -> float:
        return max(self.values.values())

    @property
    def seeds(self) -> int:
        return len(self.values)

    def text(self, digits: int = 3, scale: float = 1.0, unit: str = "", sign: bool = False) -> str:
        """'1.421' for one seed; '1.421 (1.402-1.440)' for several: their mean and range."""
        form = f"{'+' if sign else ''}.{digits}f"
        mean = f"{self.mean * scale:{form}}{unit}"
        if self.seeds == 1:
            return mean
        return f"{mean} ({self.low * scale:{form}}{unit} to {self.high * scale:{form}}{unit})"


def seed_models(results: Results, scheme: str, section: Mapping[str, Any]) -> dict[str, str]:
    """Seed name -> model name of the scheme's models that `section` has figures for, the served one
    first ("1234"; "served" where the run did not record the scheme's seeds)."""
    return {"served" if seed is None else str(seed): model for seed, model in results.seeded(scheme, section).items()}


def across(
    results: Results, scheme: str, section: Mapping[str, Any], figure: Callable[[str], float | None]
) -> AcrossSeeds | None:
    """`figure(model)` on each of the scheme's seeds that `section` has (None: no seed has it)."""
    values = {seed: value for seed, model in seed_models(results, scheme, section).items()
              if (value := figure(model)) is not None}  # fmt: skip
    return AcrossSeeds(values) if values else None


def agreement(said: dict[str, str]) -> str:
    """Whether one verdict holds on every seed (seed -> what it says): 'on every seed (3)', or which
    seeds say what; empty for one seed (the label says so)."""
    if len(said) < 2:
        return ""
    kinds: dict[str, list[str]] = {}
    for seed, kind in said.items():
        kinds.setdefault(kind, []).append(seed)
    if len(kinds) == 1:
        return f"holds on all {len(said)} seeds"
    parts = [f"{kind} on seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}" for kind, seeds in kinds.items()]
    return "**seeds disagree**: " + "; ".join(parts)


def many_seeds(results: Results) -> bool:
    """Whether any scheme of the run was scored on more than one training seed."""
    return any(len(results.seeds.get(scheme, [])) > 1 for scheme in results.schemes)


def label(results: Results, scheme: str) -> str:
    """The scheme as a verdict names it: with its seed count where the run has several seeds of some
    scheme ('rope (3 seeds)', 'sinusoidal (one seed)'), plain otherwise."""
    if not many_seeds(results):
        return scheme
    count = len(results.seeds.get(scheme, [])) or 1
    return f"{scheme} ({'one seed' if count == 1 else f'{count} seeds'})"


def seeds_note(results: Results) -> str:
    """One line on what the verdicts rest on, for the top of the Findings."""
    if not many_seeds(results):
        return "Every verdict below rests on one trained model per scheme (the served one).\n"
    counted = ", ".join(f"{s} {len(results.seeds.get(s, [])) or 1}" for s in results.schemes)
    return (
        f"Training seeds scored per scheme: {counted}. A figure over several seeds is their mean with their "
        "range (lowest to highest seed); a verdict says whether it holds on every seed, and where seeds "
        "disagree, which says what.\n"
    )
