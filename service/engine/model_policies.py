"""What a served model offers its clients, read off its manifest at start-up: the cache policies its
export can serve (their forms label the metrics; their syntax is what ListModels shows) and where
eviction puts positions (service.engine.core.model_infos sends them to the front end)."""

from __future__ import annotations

from contract.cache_policy import FORM_POLICIES, FORM_SYNTAX
from contract.manifest import Manifest


def policy_forms(manifest: Manifest) -> list[str]:
    """The cache-policy forms a model accepts (CachePolicy.form: the `policy` metric label): those
    whose policies its export has what they need for (CachePolicy.missing)."""
    return [form for form, policy in FORM_POLICIES.items() if policy.missing(manifest) is None]


def policy_syntax(manifest: Manifest) -> list[str]:
    """The policies a model accepts, as ListModels shows them."""
    return [FORM_SYNTAX[form] for form in policy_forms(manifest)]


def eviction_positions(manifest: Manifest) -> str:
    """Where a bounded row's keys sit after evictions (the export's cache_eviction), "" without one."""
    eviction = manifest.cache_eviction
    return "" if eviction is None else eviction.positions
