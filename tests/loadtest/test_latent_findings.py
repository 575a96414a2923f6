"""The Findings' latent-attention paragraph: mla against rope, rnope-swa, relative and alibi, its
quality verdict over seeds, and what a cut cache buys under one budget beside what its prompts cost."""

import pytest

from loadtest.report.findings import findings_section
from loadtest.report.latent import latent_schemes, latent_section
from loadtest.study.results import Results

pytestmark = pytest.mark.unit


def results(mla_seeds: tuple[float, float, float] = (1.41, 1.43, 1.42)) -> Results:
    found = Results("r", {}, {}, ["rope", "alibi", "rnope-swa", "mla"])
    found.seeds = {"rope": [1234, 2, 3], "mla": [1234, 2, 3]}
    found.quality = {
        "rope": {"1": 1.40, "8": 2.00}, "rope@seed2": {"1": 1.38}, "rope@seed3": {"1": 1.42},
        "alibi": {"1": 1.50, "8": 1.60}, "rnope-swa": {"1": 1.42, "8": 1.70},
        "mla": {"1": mla_seeds[0], "8": 1.90}, "mla@seed2": {"1": mla_seeds[1]}, "mla@seed3": {"1": mla_seeds[2]},
    }  # fmt: skip
    found.kv_footprint = {
        "rope": {"kv_bytes_per_token@256": 4864, "kv_bytes_per_token@4096": 4096, "requests_4kb@budget": 8},
        "rnope-swa": {"kv_bytes_per_token@256": 2944, "kv_bytes_per_token@4096": 1132, "requests_4kb@budget": 28},
        "mla": {"kv_bytes_per_token@256": 1520, "kv_bytes_per_token@4096": 1280, "requests_4kb@budget": 25},
    }  # fmt: skip
    found.ttft = {"rope": {"2048": 0.10}, "mla": {"2048": 0.22}}
    budget = {"tokens_per_s": 100.0, "running_peak": 8.0, "users": 32, "goodput_per_s": 0.1}
    found.load_budget = {"rope": budget, "mla": {**budget, "tokens_per_s": 60.0, "running_peak": 25.0}}  # type: ignore[typeddict-item]
    return found


def test_mla_is_set_beside_rope_the_hybrid_relative_and_alibi() -> None:
    text = latent_section(results())
    assert latent_schemes(results()) == ["mla"]
    assert text.startswith("**What latent attention costs and buys**")
    assert "0.31x/0.31x rope's, 0.52x/1.13x rnope-swa's" in text  # bytes a token at 256 and 4,096
    assert "holds 25 4 KB requests at once against rope's 8 (3.1x)" in text
    assert "2.20x rope's time to first token at 2048 bytes" in text
    assert "ran 25 requests at once against rope's 8, for 60 tokens/s against 100 (0.60x)" in text
    assert "Not yet measured for it in this report: latency, speculation, reuse." in text


def test_quality_is_the_mean_over_seeds_and_says_whether_every_seed_holds() -> None:
    text = latent_section(results())
    assert "1.420 (1.410 to 1.430) bits/byte at the training length against rope's 1.400 (1.380 to 1.420)" in text
    assert "+1.4%, within 3% of rope's mean (holds on all 3 seeds)" in text
    split = latent_section(results((1.41, 1.46, 1.42)))
    assert "**seeds disagree**: within 3% on seeds 1234, 3; not within 3% on seed 2" in split


def test_the_findings_carry_it_and_a_run_without_mla_has_none() -> None:
    assert "What latent attention costs and buys" in findings_section(results())
    assert latent_section(Results("r", {}, {}, ["rope", "alibi"])) == ""
