"""The comparison on every training seed of a scheme (issue 55), for real: the scored sections, the
reuse section's answers and speculation on a scheme's served model and a further seed of it beside it
(a perturbed stand-in, tests/standins.py), each seed's figures kept under its model name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.compare import main as compare_main
from tests.loadtest.test_reuse import base_run


def test_the_scored_sections_run_on_every_seed_and_the_report_says_so(seeded_repository: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    base_run(out)
    sections = ["quality", "retrieval", "cache", "reuse", "speculative"]
    command = ["--tiny", "--extra-seeds", "--sections", *sections, "--schemes", "alibi", "--model-repository",
               str(seeded_repository), "--weights", str(seeded_repository.parent / "weights"), "--out", str(out),
               "--threads", "1"]  # fmt: skip
    assert compare_main(command) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["seeds"]["alibi"] == [1234, 2]
    for section in ("quality", "retrieval", "cache_budget", "reuse", "speculative"):
        assert {"alibi", "alibi@seed2"} <= set(results[section]), section
    assert results["quality"]["alibi"]["0.5"] != results["quality"]["alibi@seed2"]["0.5"]  # another checkpoint
    seeded, served = results["reuse"]["alibi@seed2"], results["reuse"]["alibi"]
    assert "shared_prefix" in served and "shared_prefix" not in seeded  # the served model's timings only
    modes = seeded["documents"]["short"]["modes"]
    assert modes["as_is"]["change"]["clusters"] == 1 and modes["as_is"]["ttft_s"] is None  # in-process only
    assert served["documents"]["short"]["modes"]["as_is"]["ttft_s"] is not None
    acceptance = results["speculative"]["alibi@seed2"]["repeats@1"]
    assert acceptance["acceptance_interval"] is None or 0 <= acceptance["acceptance_interval"]["low"] <= 1
    report = (out / "report.md").read_text()
    assert "Training seeds scored per scheme: alibi 2" in report
    assert "- **alibi (2 seeds)**: " in report and "| alibi@seed2 |" in report


def test_seeds_only_scores_the_further_seed_and_leaves_the_served_models_figures(
    seeded_repository: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report"
    base_run(out)
    sections = ["quality", "reuse", "speculative"]
    command = ["--tiny", "--extra-seeds", "--seeds-only", "--sections", *sections, "--schemes", "alibi",
               "--model-repository", str(seeded_repository), "--out", str(out), "--threads", "1",
               "--weights", str(seeded_repository.parent / "weights")]  # fmt: skip
    assert compare_main(command) == 0
    results = json.loads((out / "results.json").read_text())
    for section in ("quality", "reuse", "speculative"):
        assert set(results[section]) == {"alibi@seed2"}, section  # the served model's figures not measured again
    assert results["config"]["runs"][-1]["budget"]["seeds_only"] is True
    results["quality"]["alibi@seed2"] = {"0.5": 123.0}  # held: a second run leaves it as it is
    (out / "results.json").write_text(json.dumps(results))
    assert compare_main([*command[:3], "--sections", "quality", *command[7:]]) == 0
    assert json.loads((out / "results.json").read_text())["quality"]["alibi@seed2"] == {"0.5": 123.0}


def test_seeds_only_refuses_sections_that_are_the_served_models(seeded_repository: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    base_run(out)
    command = ["--tiny", "--extra-seeds", "--seeds-only", "--sections", "quality", "latency", "--schemes", "alibi",
               "--model-repository", str(seeded_repository), "--out", str(out)]  # fmt: skip
    with pytest.raises(SystemExit, match="--seeds-only scores further training seeds"):
        compare_main(command)
