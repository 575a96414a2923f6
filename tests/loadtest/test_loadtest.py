"""Locust headless against the real service, and the comparison harness on a tiny budget."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from contract.paths import REPOSITORY_ROOT
from loadtest.compare import main as compare_main
from loadtest.study.timed import rotated
from models.checkpoints import trained_schemes
from service.process import ServerProcess, wait_for

TRAINED = trained_schemes()  # the schemes with shipped weights: what the repository fixture exports

LOCUSTFILE = REPOSITORY_ROOT / "loadtest" / "locustfile.py"


@pytest.fixture(scope="module")
def server(repository: Path):  # type: ignore[no-untyped-def]
    process = ServerProcess(repository, "--models", "alibi", "learned").wait_serving()
    yield process
    process.stop()


def request_counts(summary: str) -> dict[str, int]:
    """Requests per name (and "Aggregated") from the request table Locust prints when it quits."""
    row = r"^\S*[ ]+(?P<name>\S.*?)[ ]+(?P<count>\d+)[ ]+\d+\(\d+\.\d+%\)[ ]+\|"
    rows = re.finditer(row, summary, re.MULTILINE)
    return {row["name"]: int(row["count"]) for row in rows}


def served_rpcs(server: ServerProcess) -> float:
    """posenc_requests_total over every method, model and code (no sample yet: 0)."""
    try:
        return server.metric("posenc_requests_total")
    except KeyError:
        return 0.0


def assert_server_counted_each_call_once(served: Callable[[], float], counts: dict[str, int], summary: str) -> None:
    """The server's count of the run's calls is Locust's Aggregated line, give or take the streams
    Locust stopped as the run ended: such a stream is counted CANCELLED by the server if its request
    got there, but Locust may stop it before (connecting anew after a cancelled stream closed the
    last connection, or sending), and a call the server never saw it cannot count."""
    aggregated = counts["Aggregated"]
    stopped = sum(count for name, count in counts.items() if name.startswith("Stopped "))
    wait_for(lambda: served() == aggregated, timeout=5)
    assert aggregated - stopped <= served() <= aggregated, (served(), counts, summary)


def token_latency_rows(path: Path, counts: dict[str, int], kind: str) -> dict[tuple[str, str], dict[str, str]]:
    """The token latency CSV's rows by (measure, name), checked per model against the streams Locust counted
    as `<kind> <model>`: one TTFT per stream, an ITL for at most each, plausible values."""
    rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(path.open())}
    for model in ("alibi", "learned"):
        assert int(rows[("TTFT", model)]["Count"]) == counts[f"{kind} {model}"]  # one per stream
        assert 0 < int(rows[("ITL", model)]["Count"]) <= counts[f"{kind} {model}"]
        ttft, itl = float(rows[("TTFT", model)]["50% (ms)"]), float(rows[("ITL", model)]["95% (ms)"])
        assert 0 < ttft < 10_000 and 0 < itl < 1_000
    return rows


def test_locust_aggregate_counts_rpcs_and_token_latency_is_reported_apart(
    server: ServerProcess, tmp_path: Path
) -> None:
    before = served_rpcs(server)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "4",
        "-r", "4", "-t", "6s", "--host", server.target, "--csv", str(tmp_path / "run"), "--models", "alibi:2,learned:1",
        "--prompt-bytes", "64,300", "--only-summary",
    ]  # fmt: skip
    env = {**os.environ, "LOCUST_MAX_NEW_TOKENS": "8"}  # options read their LOCUST_* variables too
    result = subprocess.run(command, cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stderr  # Locust logs its summary to stderr, and the token latency table below it
    counts = request_counts(summary)
    # Every RPC once, nothing else: the Aggregated line is what the server counted. A stream cut
    # when the run ends is recorded as "Stopped <model>" and counted CANCELLED by the server (if it got there).
    assert counts["ListModels"] == 4
    assert counts["GenerateStream alibi"] > 0 and counts["GenerateStream learned"] > 0
    assert {name.split()[0] for name in counts} <= {"ListModels", "GenerateStream", "Stopped", "Aggregated"}
    assert counts["Aggregated"] == sum(count for name, count in counts.items() if name != "Aggregated")
    assert_server_counted_each_call_once(lambda: served_rpcs(server) - before, counts, summary)
    # Time to first token and inter-token latency: printed after Locust's summary, and in a CSV of their own.
    assert "Token latency, ms" in summary
    rows = token_latency_rows(tmp_path / "run_token_latency.csv", counts, "GenerateStream")
    assert (
        int(rows[("TTFT", "All models")]["Count"]) == counts["GenerateStream alibi"] + counts["GenerateStream learned"]
    )
    locust_rows = {row["Name"] for row in csv.DictReader((tmp_path / "run_stats.csv").open())}
    assert not any(name.startswith(("TTFT", "ITL")) for name in locust_rows)


def served_http_calls(server: ServerProcess) -> float:
    """posenc_requests_total{api="http"} over every path, model and code (no sample yet: 0)."""
    try:
        return server.metric("posenc_requests_total", api="http")
    except KeyError:
        return 0.0


def test_locust_http_user_runs_the_same_scenario_through_the_openai_api(server: ServerProcess, tmp_path: Path) -> None:
    before, grpc_before = served_http_calls(server), served_rpcs(server) - served_http_calls(server)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "4", "-r", "4", "-t", "6s",
        "--api", "http", "--host", server.http_url, "--csv", str(tmp_path / "run"), "--models", "alibi:2,learned:1",
        "--prompt-bytes", "64,300", "--cancel-fraction", "0.2", "--only-summary",
    ]  # fmt: skip
    env = {**os.environ, "LOCUST_MAX_NEW_TOKENS": "8", "LOCUST_IGNORE_EOS": "true"}
    result = subprocess.run(command, cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stderr
    counts = request_counts(summary)
    assert counts["/v1/models"] == 4
    assert counts["/v1/completions alibi"] > 0 and counts["/v1/completions learned"] > 0
    assert {name.split()[0] for name in counts} <= {"/v1/models", "/v1/completions", "Cancelled", "Stopped",
                                                     "Aggregated"}  # fmt: skip
    assert " 0(0.00%) |" in summary.split("Aggregated", 1)[1].splitlines()[0]  # no failures
    # Every HTTP call once: the server's api="http" count is Locust's Aggregated line, and no gRPC call was made.
    assert_server_counted_each_call_once(lambda: served_http_calls(server) - before, counts, summary)
    assert served_rpcs(server) - served_http_calls(server) == grpc_before
    token_latency_rows(tmp_path / "run_token_latency.csv", counts, "/v1/completions")


@pytest.mark.server  # runs a subprocess
def test_locust_help_lists_the_scenario_options() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loadtest", "--help"], cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for flag, env in [("--models", "LOCUST_MODELS"), ("--max-new-tokens", "LOCUST_MAX_NEW_TOKENS"),
                      ("--prompt-bytes", "LOCUST_PROMPT_BYTES"), ("--load-shape", "LOCUST_LOAD_SHAPE"),
                      ("--api", "LOCUST_API"), ("--ignore-eos", "LOCUST_IGNORE_EOS")]:  # fmt: skip
        assert flag in result.stdout and env in result.stdout, flag


def test_comparison_harness_writes_a_complete_report(repository: Path, tmp_path: Path) -> None:
    # The harness exports rope scaling variants into its repository: give it its own, linked.
    own = tmp_path / "repository"
    own.mkdir()
    for scheme in TRAINED:
        (own / scheme).symlink_to(repository / scheme)
    out = tmp_path / "report"
    assert compare_main(["--tiny", "--model-repository", str(own), "--out", str(out), "--threads", "1"]) == 0
    for name in ("report.md", "results.json", "bpb_vs_context.png", "itl_vs_context.png", "ttft_vs_prompt.png",
                 "throughput_vs_concurrency.png", "goodput_vs_users.png", "kv_bytes.png", "retrieval.png",
                 "retrieval_depth.png", "cache_budget.png", "reuse.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert results["schemes"] == list(TRAINED)
    for scheme in TRAINED:
        assert 0.5 < results["quality"][scheme]["0.5"] < 9.0
        assert all(v["requests"] > 0 and v["errors"] == 0 for v in results["load"][scheme].values())
        admission = results["load_admission"][scheme]
        assert set(admission) == set(results["load"][scheme])
        assert all(v["requests"] + v["refused"] > 0 and v["errors"] == 0 for v in admission.values())
        assert results["memory"][scheme]["process_peak_bytes"] > 0
        assert results["models"][scheme]["kv_bytes_per_token"] > 0
        # Every level in rounds (two in the tiny budget), each kept behind the medians above.
        for series in ("load", "load_admission"):
            assert all(len(r) == 2 for r in results["load_rounds"][series][scheme].values())
        ttft_rounds = results["latency_rounds"]["ttft"][scheme]["64"]
        assert len(ttft_rounds) == 2 and results["ttft"][scheme]["64"] == pytest.approx(sum(ttft_rounds) / 2)
        probes = results["retrieval"][scheme]
        assert set(probes) == {"copy", "copy_depth", "passkey", "natural"}
        assert set(probes["copy"]) == {"32", "512"} and set(probes["passkey"]) == {"256", "512"}
        for cell in [*probes["copy"].values(), *probes["passkey"].values(), probes["copy_depth"]["256"]["0.5"]]:
            assert cell is None or 0 <= cell["low"] <= cell["value"] <= cell["high"] <= 1
        assert probes["natural"]["all"] is not None
    assert results["quality"]["learned"]["2"] is None  # beyond its table: not servable
    assert results["retrieval"]["learned"]["copy"]["512"] is None
    assert results["retrieval"]["alibi"]["copy"]["512"] is not None
    assert results["quality"]["alibi"]["2"] is not None
    assert results["quality"]["rope-ntk-x2"]["2"] is not None
    assert (
        results["memory"]["relative"]["attention_bias_bytes"] > 0
        and results["memory"]["none"]["attention_bias_bytes"] == 0
    )
    cache = results["cache_budget"]
    assert set(cache) == set(TRAINED)
    alibi = cache["alibi"]
    assert alibi["policies"] == ["full", "window:64", "sinks:4+window:60"]
    windowed, full = alibi["bpb"]["window:64"]["2"], alibi["bpb"]["full"]["2"]
    assert windowed is not None and full is not None and windowed != full  # the 512-byte text was evicted from
    assert cache["learned"]["bpb"]["window:64"]["2"] is None  # absolute positions end at 256
    assert alibi["cost"]["window:64"]["kv_physical_bytes"] < alibi["cost"]["full"]["kv_physical_bytes"]
    assert cache["learned"]["cost"]["full"] is None  # 2048 tokens of history: not servable
    report = (out / "report.md").read_text()
    assert "not servable" in report and all(scheme in report for scheme in TRAINED)
    assert "## Cache budgets" in report and "window:64" in report
    assert "Each level was measured in 2 rounds" in report and "medians of 2 rounds [min-max]" in report
    assert set(results["reuse"]) == set(TRAINED) and "## KV reuse" in report  # every section in a full run
    # One KV budget with 4 KB prompts: every scheme whose positions reach that far, none failing.
    assert set(results["load_budget"]) == set(TRAINED) - {"learned"}
    assert all(f["errors"] == 0 and f["running_peak"] >= 0 for f in results["load_budget"].values())
    assert "### One KV budget, 4 KB prompts" in report
    footprint = results["kv_footprint"]
    assert footprint["rope"]["kv_bytes_per_token@4096"] == 4096
    for hybrid in {"rnope-swa", "rope-swa"} & set(TRAINED):
        assert footprint[hybrid]["kv_bytes_per_token@4096"] <= 0.3 * 4096
        assert footprint[hybrid]["requests_4kb@budget"] >= 3 * footprint["rope"]["requests_4kb@budget"]

    # A rerun of the timed sections for some schemes updates those figures in place and records itself.
    before = results
    rerun = ["--tiny", "--model-repository", str(own), "--out", str(out), "--threads", "1"]
    assert compare_main([*rerun, "--sections", "latency", "load", "--schemes", "alibi", "learned"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [run["sections"] for run in results["config"]["runs"]][-1] == ["latency", "load"]
    assert results["quality"] == before["quality"] and results["retrieval"] == before["retrieval"]
    assert results["itl"]["rope"] == before["itl"]["rope"]  # not rerun
    assert results["ttft"]["alibi"]["512"] is not None and results["ttft"]["learned"]["512"] is None
    assert results["load"]["alibi"]["2"]["requests"] > 0 and results["load_admission"]["learned"]["1"]["errors"] == 0
    assert results["memory"]["alibi"]["process_peak_bytes"] > 0
    assert "Rerun: latency, load (alibi, learned) at `" in (out / "report.md").read_text()


def test_rotated_puts_each_scheme_first_once_per_cycle() -> None:
    schemes = ["a", "b", "c"]
    orders = [rotated(schemes, turn) for turn in range(3)]
    assert [order[0] for order in orders] == schemes
    assert all(sorted(order) == schemes for order in orders)
    assert rotated(schemes, 3) == schemes
