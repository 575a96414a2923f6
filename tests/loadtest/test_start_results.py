"""A run of fewer sections updates the earlier results, and a scheme it adds joins the end of their list."""

from pathlib import Path

from loadtest.compare import QUICK_LEAVES_OUT, SECTIONS, start_results
from loadtest.study.budget import Budget
from loadtest.study.results import Results, RunRecord


def test_a_partial_run_adds_its_new_schemes_after_the_others(tmp_path: Path) -> None:
    Results("reference", {"schemes": ["rope", "alibi"]}, {}, ["rope", "alibi"]).write(tmp_path / "results.json")
    record: RunRecord = {"sections": ["quality"], "environment": {}, "budget": {}, "schemes": ["rnope-swa", "rope"]}
    results = start_results(tmp_path, "reference", {"quality"}, record, 0, ["rnope-swa", "rope"])
    assert results.schemes == ["rope", "alibi", "rnope-swa"]
    assert results.config["runs"] == [record]


def test_a_quick_run_of_its_sections_starts_new_results(tmp_path: Path) -> None:
    """--quick leaves the cache budgets, routing, tenants, reuse and speculation out (issues 64 and 61:
    README command 1 within ten minutes with nine schemes) and still writes a new run, not an update of
    an earlier one."""
    assert set(QUICK_LEAVES_OUT) == {"cache", "routing", "tenants", "reuse", "speculative"}
    assert not Budget.quick().budget_load and Budget.quick().load_rounds == 1
    whole = frozenset(SECTIONS) - set(QUICK_LEAVES_OUT)
    record: RunRecord = {"sections": sorted(whole), "environment": {}, "budget": {}, "schemes": ["rope"]}
    results = start_results(tmp_path, "quick", set(whole), record, 0, ["rope"], whole)
    assert results.schemes == ["rope"] and results.config["runs"] == [record]
