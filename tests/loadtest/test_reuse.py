"""The comparison's `reuse` section for real (`--sections reuse` against servers on loopback), its
in-process answer scoring held to the service's `Score`, the report's findings, and the Locust
users of both workloads."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from contract.paths import REPOSITORY_ROOT
from loadtest.compare import environment
from loadtest.compare import main as compare_main
from loadtest.report.reuse_tables import finding, prefix_ratios, scheme_verdict, verdict
from loadtest.study import timed
from loadtest.study.budget import Budget
from loadtest.study.results import Results, Reuse, ReuseMode
from loadtest.study.reuse_scoring import WHOLE_TOKENS, AnswerScorer, paired_change
from loadtest.workloads import DocumentPrompt, document_prompt, document_set, short_document_bytes
from models.corpus import load_corpus
from service.api import generation_pb2 as pb
from service.process import ServerProcess
from tests.loadtest.test_loadtest import LOCUSTFILE, request_counts

SCHEMES = ["alibi", "rope", "learned"]


@pytest.fixture(scope="module")
def server(repository: Path):  # type: ignore[no-untyped-def]
    process = ServerProcess(repository, "--models", "alibi", "learned").wait_serving()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def prompts():  # type: ignore[no-untyped-def]
    rng = random.Random(5)
    documents = document_set(load_corpus().text_bytes("test"), rng, short_document_bytes(256))
    return [document_prompt(documents, rng) for _ in range(3)]


def mode(bpb: float | None, ttft: float | None = 0.01, spread: float = 0.002) -> ReuseMode:
    """A mode at `bpb` against a full recompute at 2.0, its paired change +-`spread`."""
    cell = None if bpb is None else {"value": bpb, "low": bpb, "high": bpb, "n": 8}
    change = None if bpb is None else {"value": bpb / 2.0 - 1, "low": bpb / 2.0 - 1 - spread,
                                       "high": bpb / 2.0 - 1 + spread, "n": 8}  # fmt: skip
    return {"accuracy": None, "bpb": cell, "teacher_forced": None, "ttft_s": ttft, "cached_share": 0.0,
            "reused_share": 0.0, "change": change}  # fmt: skip


def reuse(declared: str, modes: dict[str, ReuseMode | None]) -> Reuse:
    load = {"1": {"ttft_p50_s": 0.5, "goodput_per_s": 1.0}, "32": {"ttft_p50_s": 2.0, "goodput_per_s": 1.0}}
    cached = {"1": {"ttft_p50_s": 0.04, "goodput_per_s": 5.0}, "32": {"ttft_p50_s": 0.1, "goodput_per_s": 4.0}}
    return {
        "segment_reuse": declared,
        "shared_prefix": {"prefix_bytes": 1536, "tail_bytes": 64, "new_tokens": 32, "no_cache": load, "cache": cached},
        "documents": {"short": {"document_bytes": 46, "prompt_bytes": 240.0, "trials": 8, "modes": modes}},
    }


def test_paired_bootstrap_gives_the_known_interval() -> None:
    """Every prompt 2% worse: the interval is the point. Half the prompts 2% worse, half unchanged:
    the change is the mean of a fair coin times 2%, so its 95% interval is 1% +- 1.96 x 1% / sqrt(n)."""
    full = [1.0 + 0.1 * (i % 7) for i in range(400)]
    same = paired_change([1.02 * f for f in full], full)
    assert (same["value"], same["low"], same["high"], same["n"]) == pytest.approx((0.02, 0.02, 0.02, 400))
    ones = [1.0] * 400
    half = paired_change([1.02 if i % 2 else 1.0 for i in range(400)], ones)
    assert half["value"] == pytest.approx(0.01)
    assert half["low"] == pytest.approx(0.01 - 1.96 * 0.01 / 20, abs=1e-4)
    assert half["high"] == pytest.approx(0.01 + 1.96 * 0.01 / 20, abs=1e-4)
    assert half == paired_change([1.02 if i % 2 else 1.0 for i in range(400)], ones)  # fixed seed


def test_the_paired_bootstrap_resamples_document_sets_whole() -> None:
    """Two sets, one 4% worse and one unchanged: over prompts the interval would be narrow; over the
    two sets it spans both (a resample holds the first set 0, 1 or 2 times)."""
    full = [1.0] * 200
    bits = [1.04] * 100 + [1.0] * 100
    prompts = paired_change(bits, full)
    sets = paired_change(bits, full, [0] * 100 + [1] * 100)
    assert prompts["value"] == sets["value"] == pytest.approx(0.02)
    assert prompts["high"] - prompts["low"] < 0.01
    assert (sets["low"], sets["high"], sets["n"], sets["clusters"]) == pytest.approx((0.0, 0.04, 200, 2))


def test_verdicts_come_from_the_paired_interval() -> None:
    assert verdict({"value": 0.005, "low": -0.004, "high": 0.009, "n": 96}) == "within"
    assert verdict({"value": 0.005, "low": -0.004, "high": 0.011, "n": 96}) == "undecided"
    assert verdict({"value": 0.02, "low": 0.011, "high": 0.03, "n": 96}) == "cannot"
    assert verdict({"value": -0.02, "low": -0.03, "high": -0.011, "n": 96}) == "better"
    assert verdict({"value": -0.02, "low": -0.03, "high": -0.009, "n": 96}) == "undecided"


def test_findings_say_within_one_percent_needs_the_repair_or_cannot() -> None:
    assert "within 1%" in finding(reuse("as_is", {"full": mode(2.0), "as_is": mode(2.01)}), "short")
    undecided = finding(reuse("as_is", {"full": mode(2.0), "as_is": mode(2.01, spread=0.01)}), "short")
    assert undecided.startswith("undecided at 8 prompts")
    repaired = finding(reuse("rotate", {"full": mode(2.0), "rotate": mode(2.2), "repair:4": mode(2.1),
                                        "repair:16": mode(2.01), "repair:all": mode(2.0)}), "short")  # fmt: skip
    assert repaired.startswith("needs repair k = 16")
    sink = finding(reuse("as_is", {"full": mode(2.0), "as_is": mode(2.2), "sink": mode(2.005), "repair:4": mode(2.1)}),
                   "short")  # fmt: skip
    assert sink.startswith("needs sink-kept precompute")
    assert finding(reuse("as_is", {"full": mode(2.0), "as_is": mode(2.5), "repair:16": mode(2.4),
                                   "repair:all": mode(2.0)}), "short").startswith("cannot within 1%")  # fmt: skip
    results = Results("t", {}, {}, ["alibi"])  # type: ignore[arg-type]
    results.reuse["alibi"] = reuse("as_is", {"full": mode(2.0), "as_is": mode(2.01)})
    assert scheme_verdict(results, "alibi") == "short documents: " + finding(results.reuse["alibi"], "short")
    assert finding(reuse("recompute", {"full": mode(2.0)}), "short").startswith("cannot: positions")
    assert finding(reuse("rotate", {"full": mode(9.0), "rotate": mode(9.0)}), "short").startswith("no baseline")
    assert finding(reuse("as_is", {"full": None, "as_is": None}), "short").startswith("not measured")
    ttft, gain = prefix_ratios(reuse("as_is", {})["shared_prefix"])
    assert ttft == pytest.approx(0.08) and gain == pytest.approx(4.0)


def test_the_in_process_answer_score_is_the_services_own(server: ServerProcess, repository: Path, prompts) -> None:  # type: ignore[no-untyped-def]
    """Computed in one pass, the answer's bits are those the Score RPC gives the same text."""
    scorer = AnswerScorer(repository, "alibi", threads=1)
    for prompt in prompts:
        response = server.stub.Score(pb.ScoreRequest(model="alibi", text=prompt.text + prompt.answer), timeout=60)
        answer = list(response.token_logprobs)[-len(prompt.answer) :]
        assert scorer.score(prompt, "full").bits == pytest.approx(-sum(answer) / math.log(2), rel=1e-3)


def test_reuse_modes_change_the_answers_bits_and_a_whole_repair_restores_them(repository: Path, prompts) -> None:  # type: ignore[no-untyped-def]
    scorer = AnswerScorer(repository, "rope", threads=1)
    for prompt in prompts:
        full = scorer.score(prompt, "full").bits
        rotated, naive = scorer.score(prompt, "rotate").bits, scorer.score(prompt, "as_is").bits
        assert rotated != pytest.approx(full, rel=1e-4) and naive != pytest.approx(rotated, rel=1e-4)
        whole = max(len(d.encode()) for d in prompt.documents)  # every token of every document recomputed
        assert scorer.score(prompt, "rotate", whole).bits == pytest.approx(full, rel=1e-3, abs=1e-3)


REUSING = ["relative", "rope", "alibi", "none", "mla"]


def test_whole_document_repair_is_the_full_recompute_for_every_scheme(repository: Path, prompts) -> None:  # type: ignore[no-untyped-def]
    """The repair curve's last point: every token of every document recomputed in context."""
    for scheme in REUSING:
        scorer = AnswerScorer(repository, scheme, threads=1)
        for prompt in prompts:
            full, whole = scorer.score(prompt, "full"), scorer.score(prompt, scorer.declared.mode, WHOLE_TOKENS)
            assert abs(whole.bits - full.bits) / full.length < 1e-4, scheme


def test_a_sink_kept_first_document_is_the_full_recompute(repository: Path, prompts) -> None:  # type: ignore[no-untyped-def]
    """A lone document right after the prompt's BOS, precomputed after a BOS of its own: its K/V is
    the full prefill's (rope's keys turned back one position, then by the offset), unlike plain reuse."""
    for scheme in REUSING:
        scorer = AnswerScorer(repository, scheme, threads=1)
        lone = DocumentPrompt((prompts[0].documents[prompts[0].carrier],), 0, prompts[0].answer)
        full = scorer.score(lone, "full")
        assert abs(scorer.score(lone, "sink").bits - full.bits) / full.length < 1e-4, scheme
        # plain reuse (no sink) is not: mla's answer moves least, 7e-3 bits a byte on these prompts
        assert abs(scorer.score(lone, scorer.declared.mode).bits - full.bits) / full.length > 1e-3, scheme


def base_run(out: Path) -> None:
    """An earlier run's results.json for `--sections reuse` to update."""
    config = {"budget": asdict(Budget.tiny()), "threads": 1, "schemes": SCHEMES,
              "goodput_targets": {"ttft_s": timed.TTFT_TARGET_S, "itl_s": timed.ITL_TARGET_S},
              "admission_ttft_slo_s": timed.ADMISSION_TTFT_SLO_S}  # fmt: skip
    out.mkdir(parents=True)
    Results("base", config, environment(), SCHEMES).write(out / "results.json")  # type: ignore[arg-type]


def test_sections_reuse_measures_both_workloads_and_reports_them(repository: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    base_run(out)
    command = ["--tiny", "--sections", "reuse", "--schemes", *SCHEMES, "--model-repository", str(repository),
               "--out", str(out), "--threads", "1"]  # fmt: skip
    assert compare_main(command) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["runs"][-1]["sections"] == ["reuse"]
    found = results["reuse"]
    assert {scheme: found[scheme]["segment_reuse"] for scheme in SCHEMES} == {
        "alibi": "as_is", "rope": "rotate", "learned": "recompute"
    }  # fmt: skip
    for scheme in SCHEMES:
        shared = found[scheme]["shared_prefix"]
        for series in ("cache", "no_cache"):
            assert set(shared[series]) == {"1", "2"}
            assert all(v["requests"] + v["refused"] > 0 and v["errors"] == 0 for v in shared[series].values())
    assert found["learned"]["shared_prefix"]["prefix_bytes"] < 256 < found["alibi"]["shared_prefix"]["prefix_bytes"]
    alibi, rope, learned = (found[s]["documents"] for s in SCHEMES)
    assert set(alibi["short"]["modes"]) == {"full", "prefix", "as_is", "sink", "repair:4", "repair:all"}
    assert set(rope["short"]["modes"]) == {"full", "prefix", "as_is", "rotate", "sink", "repair:4", "repair:all"}
    assert alibi["short"]["modes"]["repair:all"]["change"]["value"] == pytest.approx(0, abs=1e-4)
    assert set(found["alibi"]["samples"]["7"]["short"]) == set(alibi["short"]["modes"]) - {"prefix"}
    assert set(found["learned"]["samples"]["7"]) == {"short"}  # the long form is past its positions
    assert set(learned["short"]["modes"]) == {"full", "prefix"}  # recompute: nothing else is asked of it
    assert learned["long"]["modes"]["full"] is None  # 4 x 256 bytes: past its positions
    for form in ("short", "long"):
        modes = alibi[form]["modes"]
        assert modes["as_is"]["reused_share"] > 0.5 and modes["full"]["reused_share"] == 0
        assert modes["full"]["bpb"]["value"] > 0 and 0 <= modes["as_is"]["accuracy"]["value"] <= 1
        assert modes["prefix"]["bpb"] == modes["full"]["bpb"]
    naive = rope["short"]["modes"]["as_is"]
    assert naive["ttft_s"] is None and naive["bpb"] is not None  # in-process only: the server rotates rope
    assert (out / "reuse.png").stat().st_size > 0 and (out / "reuse_repair.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "## KV reuse" in report and "reuse, rope re-rotated" in report and "What reuse buys each scheme" in report


def prefix_hits(server: ServerProcess, model: str) -> float:
    """Prompt tokens the prefix cache held for `model` so far (no sample yet: 0)."""
    try:
        return server.metric("posenc_prefix_cache_hit_tokens_total", model=model)
    except KeyError:
        return 0.0


def test_locust_runs_both_reuse_workloads_by_name(server: ServerProcess, tmp_path: Path) -> None:
    hits_before = prefix_hits(server, "alibi")
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "4", "-r", "4", "-t", "5s",
        "--host", server.target, "--models", "alibi:1,learned:1", "--only-summary", "SharedPrefixUser",
        "DocumentsUser",
    ]  # fmt: skip
    env = {**os.environ, "LOCUST_MAX_NEW_TOKENS": "8"}
    result = subprocess.run(command, cwd=REPOSITORY_ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    counts = request_counts(result.stderr)
    for name in ("SharedPrefix alibi", "SharedPrefix learned", "Documents alibi", "Documents learned"):
        assert counts.get(name, 0) > 0, (name, counts)
    assert " 0(0.00%) |" in result.stderr.split("Aggregated", 1)[1].splitlines()[0]  # no failures
    assert prefix_hits(server, "alibi") > hits_before  # the shared prefix was found cached
