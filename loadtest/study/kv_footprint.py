"""The memory section's K/V footprint, read off the served KV store itself (bytes its arrays allocate),
not off the architecture: K/V bytes per token at 256, 1,024 and 4,096 tokens of sequence, and how many
4 KB requests one fixed KV budget holds at once.

A hybrid's local layers keep only their window, so its bytes per token fall as the sequence grows;
every other scheme holds the same bytes for every token of every layer. Measured in-process on the
runner the server builds (same layout, same store, same block size), with no prefix cache.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from contract.manifest import Manifest
from loadtest.study.results import Results
from service.engine.messages import EngineConfig
from service.engine.worker.runner import ModelRunner, StoreConfig

FOOTPRINT_TOKENS = (256, 1024, 4096)
REQUEST_TOKENS = 4096  # a 4 KB prompt (one byte a token) and its answer: the comparison's longest sequence
# The fixed budget: what 8 such requests take at 4,096 bytes a token (every classic scheme's figure).
BUDGET_REQUESTS, CLASSIC_TOKEN_BYTES = 8, 4096
FIXED_BUDGET_BYTES = BUDGET_REQUESTS * REQUEST_TOKENS * CLASSIC_TOKEN_BYTES


def _runner(folder: Path, budget_bytes: int) -> ModelRunner:
    config = EngineConfig()
    return ModelRunner(Manifest.load(folder), StoreConfig(budget_bytes, config.block_size, REQUEST_TOKENS), "cpu", 1)


def bytes_per_token(folder: Path) -> dict[int, float]:
    """Allocated K/V bytes over tokens for one sequence of each length the model can hold."""
    limit = Manifest.load(folder).max_positions
    store = _runner(folder, 1 << 34).store
    figures: dict[int, float] = {}
    for tokens in FOOTPRINT_TOKENS:
        if limit is not None and tokens > limit:
            continue
        before = store.stats().physical_bytes
        if not store.reserve("footprint", tokens):
            raise RuntimeError(f"{folder.name}: the store refused one sequence of {tokens} tokens")
        figures[tokens] = (store.stats().physical_bytes - before) / tokens
        store.free("footprint")
    return figures


def requests_within(folder: Path, budget_bytes: int = FIXED_BUDGET_BYTES) -> int | None:
    """How many sequences of REQUEST_TOKENS the store admits at once within `budget_bytes` (None: the
    model cannot hold one, e.g. a learned table shorter than a 4 KB prompt)."""
    limit = Manifest.load(folder).max_positions
    if limit is not None and REQUEST_TOKENS > limit:
        return None
    store = _runner(folder, budget_bytes).store
    admitted = 0
    while store.reserve(f"request-{admitted}", REQUEST_TOKENS):
        admitted += 1
    return admitted


def kv_footprint(folder: Path) -> dict[str, float]:
    """The figures results.memory keeps for one model: `kv_bytes_per_token@<N>` and `requests_4kb@budget`
    (with the budget in `fixed_budget_bytes`)."""
    figures: dict[str, float] = {f"kv_bytes_per_token@{n}": b for n, b in bytes_per_token(folder).items()}
    admitted = requests_within(folder)
    if admitted is not None:
        figures["requests_4kb@budget"] = admitted
        figures["fixed_budget_bytes"] = FIXED_BUDGET_BYTES
    return figures


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtest.study.kv_footprint --model-repository R REPORT_FOLDER [--schemes ...]`: measure
    the footprint alone (seconds, no server) and record it in a report's results.json, as the cache
    section does."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.study.kv_footprint", description=main.__doc__)
    parser.add_argument("folder", type=Path, help="the report folder, holding results.json")
    parser.add_argument("--model-repository", type=Path, required=True)
    parser.add_argument("--schemes", nargs="+", default=None, help="default: the report's schemes")
    args = parser.parse_args(argv)
    results = Results.read(args.folder / "results.json")
    for scheme in args.schemes or results.schemes:
        results.kv_footprint[scheme] = kv_footprint(args.model_repository / scheme)
        print(scheme, results.kv_footprint[scheme])
    results.write(args.folder / "results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
