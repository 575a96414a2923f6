"""The memory section's footprint, read off the served store: a hybrid's local layers hold only their
window, so at 4,096 tokens it allocates at most 0.3 of rope's bytes and one budget holds 3x its requests."""

from pathlib import Path

from loadtest.report.tables import footprint_table
from loadtest.study.kv_footprint import FIXED_BUDGET_BYTES, kv_footprint
from loadtest.study.results import Results


def test_a_hybrid_holds_a_fraction_of_rope_s_bytes_and_three_times_its_requests(repository: Path) -> None:
    rope = kv_footprint(repository / "rope")
    assert rope["kv_bytes_per_token@4096"] == 4096  # 2 x 4 layers x 128 x float32, a class exactly 4,096 wide
    assert rope["requests_4kb@budget"] == 8 and rope["fixed_budget_bytes"] == FIXED_BUDGET_BYTES
    for hybrid in ("rnope-swa", "rope-swa"):
        figures = kv_footprint(repository / hybrid)
        assert figures["kv_bytes_per_token@4096"] <= 0.3 * rope["kv_bytes_per_token@4096"], figures
        assert figures["kv_bytes_per_token@256"] > figures["kv_bytes_per_token@4096"]  # the window is amortised
        assert figures["requests_4kb@budget"] >= 3 * rope["requests_4kb@budget"], figures
    results = Results("r", {}, {}, ["rope", "rnope-swa"], kv_footprint={"rope": rope, "rnope-swa": figures})
    table = footprint_table(results)
    assert "| rope | 4,864 (1.00x)" in table and "128 MB" in table
