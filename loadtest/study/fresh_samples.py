"""Does a report's reuse interval hold fresh prompt samples? `python -m loadtest.study.fresh_samples`.

Draws further prompt samples of the documents workload with seeds the report did not use (the same
budget, `Workloads.build`, the same in-process scorer as the `reuse` section), scores each scheme's
own placement against the full recompute, and says which samples' figures fall inside the report's
paired 95% interval. A sound interval holds about 4 in 5 of them (two samples' difference has twice
one sample's variance: P(|Z| < 1.96 / sqrt 2) = 0.83); issue 55's acceptance asks 4 of 5.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from contract.cli import HelpFormatter
from contract.paths import REPOSITORY_ROOT
from loadtest.study.budget import Budget
from loadtest.study.held_out import HeldOut
from loadtest.study.results import Cell, Results
from loadtest.study.reuse import Workloads
from loadtest.study.reuse_scoring import AnswerScorer, paired_change


def budget_of(results: Results) -> Budget:
    """The budget the results' first run measured with (fields a later Budget added keep their defaults)."""
    recorded = results.config.get("budget", {})
    known = {f.name for f in dataclasses.fields(Budget)}
    return Budget(**{key: tuple(v) if isinstance(v, list) else v for key, v in recorded.items() if key in known})


def fresh_changes(
    repository: Path, model: str, declared: str, form: str, seeds: list[int], budget: Budget, threads: int
) -> dict[int, Cell]:
    """Each fresh sample's paired change of the declared placement from the full recompute."""
    scorer = AnswerScorer(repository, model, threads)
    changes = {}
    for seed in seeds:
        prompts = Workloads.build(HeldOut(), budget, scorer.manifest.train_context, seed).forms[form]
        full = [s.bits for s in scorer.scores(prompts, "full")]
        placed = [s.bits for s in scorer.scores(prompts, declared)]
        changes[seed] = paired_change(placed, full, [p.document_set for p in prompts])
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.study.fresh_samples", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--report", type=Path, default=REPOSITORY_ROOT / "reports" / "reference", help="report folder")
    parser.add_argument("--model-repository", type=Path, default=REPOSITORY_ROOT / "model_repository")
    parser.add_argument("--schemes", nargs="+", default=["relative", "rope", "alibi"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[101, 102, 103, 104, 105], help="prompt samples")
    parser.add_argument("--form", default="short", help="documents form (short, long)")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its default)")
    args = parser.parse_args(argv)
    results = Results.read(args.report / "results.json")
    budget = budget_of(results)
    used = set(budget.reuse_seeds) & set(args.seeds)
    if used:
        parser.error(f"--seeds: {sorted(used)} are the report's own prompt samples")
    for scheme in args.schemes:
        reuse = results.reuse[scheme]
        declared = reuse["segment_reuse"]
        interval = reuse["documents"][args.form]["modes"][declared]["change"]  # type: ignore[index]
        changes = fresh_changes(args.model_repository, scheme, declared, args.form, args.seeds, budget, args.threads)
        inside = [seed for seed, c in changes.items() if interval["low"] <= c["value"] <= interval["high"]]
        figures = ", ".join(f"{c['value']:+.1%}" for c in changes.values())
        print(f"{scheme} ({declared}): report {interval['value']:+.1%} [{interval['low']:+.1%}, "
              f"{interval['high']:+.1%}]; fresh samples {figures}: {len(inside)} of {len(changes)} inside")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
