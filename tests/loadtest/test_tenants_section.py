"""The tenants section, tiny: a noisy and a quiet tenant on real servers under both policies, the
results' shape and the report's table and Findings line."""

from __future__ import annotations

from pathlib import Path

from loadtest.report.findings import findings_section
from loadtest.report.tenants_tables import tenants_section
from loadtest.study import tenants
from loadtest.study.budget import Budget
from loadtest.study.held_out import HeldOut
from loadtest.study.results import Results


class Progress:
    def __init__(self) -> None:
        self.steps = 0

    def update(self, steps: int) -> None:
        self.steps += steps


def test_the_tiny_section_fills_results_and_the_report(repository: Path) -> None:
    results = Results("tiny", {}, {}, ["rope"])  # type: ignore[typeddict-item]
    progress, budget = Progress(), Budget.tiny()
    tenants.measure_tenants(repository, 1, HeldOut(), budget, results, progress)  # type: ignore[arg-type]
    assert progress.steps == 3 * budget.load_rounds
    for policy in ("fcfs", "fair"):
        cell = results.tenants[policy]
        assert len(cell["rounds"]) == budget.load_rounds
        for tenant in ("noisy", "quiet"):
            assert cell[tenant]["requests"] > 0 and cell[tenant]["ttft_p50_s"] > 0 and cell[tenant]["tokens_per_s"] > 0
            assert all(r[tenant]["errors"] == 0 for r in cell["rounds"])
        assert cell["quiet_ttft_vs_solo"] > 0 and cell["noisy_throughput_vs_solo"] > 0
    text = tenants_section(results)
    assert "| fair (deficit round robin) | quiet |" in text and "| alone | noisy |" in text
    assert "Tenants: 1 quiet streams beside 4 noisy ones" in findings_section(results)
