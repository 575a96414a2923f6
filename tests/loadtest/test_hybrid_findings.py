"""The Findings' hybrid paragraph: each hybrid against rope, relative and alibi, from what was measured."""

from loadtest.report.findings import compact_headline, memory_verdict
from loadtest.report.hybrids import hybrid_schemes, hybrids_section
from loadtest.report.tables import headline_table, memory_table
from loadtest.study.results import Results


def results() -> Results:
    found = Results("r", {}, {}, ["rope", "alibi", "rnope-swa"])
    found.quality = {"rope": {"1": 1.40, "8": 2.00}, "alibi": {"1": 1.50, "8": 1.60},
                     "rnope-swa": {"1": 1.42, "8": 1.70}}  # fmt: skip
    copy = {"32": {"value": 1.0, "low": 0.9, "high": 1.0}, "2048": {"value": 0.4, "low": 0.3, "high": 0.5}}
    found.retrieval = {"rope": {"copy": copy}, "rnope-swa": {"copy": copy}}  # type: ignore[typeddict-item]
    found.kv_footprint = {"rope": {"kv_bytes_per_token@4096": 4096, "requests_4kb@budget": 8},
                          "rnope-swa": {"kv_bytes_per_token@4096": 1130, "requests_4kb@budget": 29}}  # fmt: skip
    return found


def test_each_hybrid_is_set_beside_its_rivals_and_says_what_is_missing() -> None:
    text = hybrids_section(results())
    assert hybrid_schemes(results()) == ["rnope-swa"]
    assert "+1.4% of rope's at 1x, -15.0% at 8x" in text and "-5.3% of alibi's at 1x" in text
    assert "(within 3% of rope at the training length)" in text
    assert "copy 0.40 [0.30, 0.50] at 2048 bytes apart (against rope 0.40 [0.30, 0.50])" in text
    assert "0.28x at 4096 tokens of rope's" in text and "holds 29 4 KB requests at once against rope's 8" in text
    assert "Not yet measured for it in this report: latency, speculation, reuse, load under one KV budget." in text


def test_a_run_without_hybrids_has_no_paragraph() -> None:
    assert hybrids_section(Results("r", {}, {}, ["rope", "alibi"])) == ""


def test_a_split_hybrid_shows_its_fixed_bytes_a_sequence_beside_its_bytes_a_token() -> None:
    """ListModels' per-token figure of a split hybrid is its global layers' alone (1,024): the tables
    and the memory verdict add the local columns every row carries; older results have neither."""
    found = results()
    found.retrieval = {}  # no probes: their cells are not what this checks
    found.models = {
        "rope": {"max_positions": None, "kv_bytes_per_token": 4096, "kv_capacity_bytes": 1, "train_context": 256},
        "alibi": {"max_positions": None, "kv_bytes_per_token": 4096, "kv_bytes_per_sequence": 0,
                  "kv_capacity_bytes": 1, "train_context": 256},
        "rnope-swa": {"max_positions": None, "kv_bytes_per_token": 1024, "kv_bytes_per_sequence": 442368,
                      "kv_capacity_bytes": 1, "train_context": 256},
    }  # fmt: skip
    found.memory = {scheme: {"kv_peak_bytes": 1e6, "process_peak_bytes": 1e8, "input_embedding_bytes": 0,
                             "attention_bias_bytes": 0, "rotary_bytes": 0} for scheme in found.models}  # fmt: skip
    assert memory_verdict(found, "rnope-swa").startswith("1024 B/token (+442 KB a sequence)")
    assert memory_verdict(found, "rope").startswith("4096 B/token")
    for table in (headline_table(found), memory_table(found), compact_headline(found)):
        rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()}
        assert "| 1024 (+442 KB a sequence) |" in rows["rnope-swa"], table
        assert "| 4096 |" in rows["rope"] and "| 4096 |" in rows["alibi"] and "KB" not in rows["alibi"], table
