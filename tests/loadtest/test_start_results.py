"""A run of fewer sections updates the earlier results, and a scheme it adds joins the end of their list."""

from pathlib import Path

from loadtest.compare import start_results
from loadtest.study.results import Results, RunRecord


def test_a_partial_run_adds_its_new_schemes_after_the_others(tmp_path: Path) -> None:
    Results("reference", {"schemes": ["rope", "alibi"]}, {}, ["rope", "alibi"]).write(tmp_path / "results.json")
    record: RunRecord = {"sections": ["quality"], "environment": {}, "budget": {}, "schemes": ["rnope-swa", "rope"]}
    results = start_results(tmp_path, "reference", {"quality"}, record, 0, ["rnope-swa", "rope"])
    assert results.schemes == ["rope", "alibi", "rnope-swa"]
    assert results.config["runs"] == [record]
