"""Locust headless against the real service, and the comparison harness on a tiny budget."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.compare import main as compare_main
from models.positional import SCHEMES
from service.process import ROOT, ServerProcess


@pytest.fixture(scope="module")
def server(repository: Path):  # type: ignore[no-untyped-def]
    process = ServerProcess(repository, "--models", "alibi", "learned").wait_serving()
    yield process
    process.stop()


def test_locust_headless_makes_requests_without_failures(server: ServerProcess, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless", "-u", "4",
        "-r", "4", "-t", "6s", "--host", server.target, "--csv", str(tmp_path / "run"), "--models", "alibi:2,learned:1",
        "--prompt-bytes", "64,300", "--max-new-tokens", "8", "--only-summary",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["Name"]: row for row in csv.DictReader((tmp_path / "run_stats.csv").open())}
    for name in ("GenerateStream alibi", "GenerateStream learned", "TTFT alibi", "ITL alibi"):
        assert int(rows[name]["Request Count"]) > 0, name
        assert int(rows[name]["Failure Count"]) == 0, name
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    assert float(rows["TTFT alibi"]["Median Response Time"]) <= float(rows["GenerateStream alibi"]["Max Response Time"])


def test_comparison_harness_writes_a_complete_report(repository: Path, tmp_path: Path) -> None:
    # The harness exports rope scaling variants into its repository: give it its own, linked.
    own = tmp_path / "repository"
    own.mkdir()
    for scheme in SCHEMES:
        (own / scheme).symlink_to(repository / scheme)
    out = tmp_path / "report"
    assert compare_main(["--tiny", "--model-repository", str(own), "--out", str(out), "--threads", "1"]) == 0
    for name in ("report.md", "results.json", "bpb_vs_context.png", "itl_vs_context.png", "ttft_vs_prompt.png",
                 "throughput_vs_concurrency.png", "kv_bytes.png", "retrieval.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert results["schemes"] == list(SCHEMES)
    for scheme in SCHEMES:
        assert 0.5 < results["quality"][scheme]["0.5"] < 9.0
        assert all(v["requests"] > 0 and v["errors"] == 0 for v in results["load"][scheme].values())
        assert results["memory"][scheme]["process_peak_bytes"] > 0
        assert results["models"][scheme]["kv_bytes_per_token"] > 0
        assert set(results["retrieval"][scheme]) == {"64", "512"}
    assert results["quality"]["learned"]["2"] is None  # beyond its table: not servable
    assert results["quality"]["alibi"]["2"] is not None
    assert results["quality"]["rope-ntk-x2"]["2"] is not None
    assert (
        results["memory"]["relative"]["attention_bias_bytes"] > 0
        and results["memory"]["none"]["attention_bias_bytes"] == 0
    )
    report = (out / "report.md").read_text()
    assert "not servable" in report and all(scheme in report for scheme in SCHEMES)
