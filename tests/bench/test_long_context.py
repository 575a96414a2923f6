"""The long-context section's ratios: each hybrid over rope, at the contexts both ran."""

from bench.long_context import hybrid_ratios


def test_each_hybrid_is_divided_by_rope_at_its_context() -> None:
    table = {"rope": {256: 2.0, 4096: 8.0}, "rnope-swa": {256: 1.0, 4096: 2.0}, "alibi": {4096: 9.0},
             "rope-swa": {256: 1.5}}  # fmt: skip
    assert hybrid_ratios(table, 4096) == {"rnope-swa": 0.25}
    assert hybrid_ratios(table, 256) == {"rnope-swa": 0.5, "rope-swa": 0.75}
    assert hybrid_ratios({"rnope-swa": {256: 1.0}}, 256) == {}  # no rope: nothing to divide by
