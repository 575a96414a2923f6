"""How big one model's KV store is, settled before its engine starts: the longest sequence a request
may reach, and whether the budget holds one of them (refused at start-up, before any session opens)."""

from __future__ import annotations

from contract.manifest import Manifest
from service.engine.kv import KVBudgetError, KVStore
from service.engine.messages import EngineConfig
from service.engine.worker.model_session import serving_plan


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
