"""The long-context section's ratios: each model that cuts the cache over rope, at the contexts both ran,
and the absorbed latent step against the up-project-every-step one."""

from types import SimpleNamespace

from bench.long_context import cuts_the_cache, hybrid_ratios
from contract.kv_spec import LayerCacheSpec

CUTTING = {"rnope-swa", "rope-swa", "mla"}


def test_each_model_that_cuts_the_cache_is_divided_by_rope_at_its_context() -> None:
    table = {"rope": {256: 2.0, 4096: 8.0}, "rnope-swa": {256: 1.0, 4096: 2.0}, "alibi": {4096: 9.0},
             "rope-swa": {256: 1.5}, "mla": {4096: 4.0}}  # fmt: skip
    assert hybrid_ratios(table, 4096, CUTTING) == {"rnope-swa": 0.25, "mla": 0.5}
    assert hybrid_ratios(table, 256, CUTTING) == {"rnope-swa": 0.5, "rope-swa": 0.75}
    assert hybrid_ratios({"rnope-swa": {256: 1.0}}, 256, CUTTING) == {}  # no rope: nothing to divide by


def test_hybrids_and_latent_attention_cut_the_cache_and_full_attention_does_not() -> None:
    full, latent = LayerCacheSpec.full(4, 32), LayerCacheSpec.latent(64, 16)
    assert cuts_the_cache(SimpleNamespace(is_hybrid=True, kv_spec=full))  # type: ignore[arg-type]
    assert cuts_the_cache(SimpleNamespace(is_hybrid=False, kv_spec=latent))  # type: ignore[arg-type]
    assert not cuts_the_cache(SimpleNamespace(is_hybrid=False, kv_spec=full))  # type: ignore[arg-type]

