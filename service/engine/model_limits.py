"""What one model may hold on this server, settled before its engine starts: the longest sequence,
a KV budget that can hold it, the cache policy of requests that name none, and the request checks
that follow from them."""

from __future__ import annotations

from contract.cache_policy import FORM_POLICIES, FORM_SYNTAX, CachePolicyError
from contract.manifest import Manifest
from service.engine.kv import KVBudgetError, KVStore
from service.engine.messages import EngineConfig, RequestError
from service.engine.processing.input_processor import InputLimits, InputProcessor
from service.engine.worker.model_session import serving_plan


def default_cache_policy(manifest: Manifest, config: EngineConfig) -> str:
    """The model's default policy string: its own MODEL=POLICY entry, else a bare POLICY, else full."""
    chosen = "full"
    for entry in config.default_cache_policies:
        name, sep, policy = entry.rpartition("=")
        if not sep:
            chosen = policy
    for entry in config.default_cache_policies:
        name, sep, policy = entry.rpartition("=")
        if sep and name == manifest.folder.name:
            chosen = policy
    return chosen


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


def sequence_limit(manifest: Manifest, config: EngineConfig) -> int:
    """Prompt (with BOS) + new tokens one request may reach on this model."""
    return manifest.max_positions or config.max_sequence_tokens


def check_kv_budget(manifest: Manifest, config: EngineConfig) -> None:
    """Refuse a budget that cannot hold one sequence of the longest allowed length (before any session
    opens), by the store's own rule on the layout the runner will give it: a split hybrid's rows hold
    the global layers' K/V a token and a fixed local part, so it fits budgets a whole row would not."""
    layout = serving_plan(manifest, config.device, config.attention, config.block_size).layout
    tokens = sequence_limit(manifest, config)
    # The store rounds its budget down to whole blocks of the global columns before it compares.
    block_bytes = config.block_size * layout.token_bytes
    minimum = -(-KVStore.minimum_budget(layout, tokens, config.block_size) // block_bytes) * block_bytes
    if config.kv_cache_bytes < minimum:
        per_sequence = f" and {layout.local_row_bytes} bytes of local layers a sequence" if layout.split else ""
        raise KVBudgetError(
            f"--kv-cache-bytes {config.kv_cache_bytes} cannot hold one sequence of {tokens} tokens "
            f"(--max-sequence-tokens, or the model's max_positions) of model {manifest.name!r} at "
            f"{layout.token_bytes} bytes per token{per_sequence}; the minimum is {minimum} bytes (one row of "
            "the widest capacity class and the row it moves from)"
        )


def input_processor(manifest: Manifest, config: EngineConfig, max_tokens: int) -> InputProcessor:
    """The model's request checks, its default cache policy resolved (and refused) at start-up."""
    limits = InputLimits(
        config.max_new_tokens_limit, config.default_max_new_tokens, max_tokens, config.speculative_tokens
    )
    inputs = InputProcessor(manifest, limits)
    try:
        inputs.default_policy = inputs.cache_policy(default_cache_policy(manifest, config))
    except RequestError as error:
        raise CachePolicyError(f"--default-cache-policy for model {manifest.name!r}: {error}") from None
    return inputs
