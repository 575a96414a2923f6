"""The long-context section: inter-token latency at long contexts for every scheme, the schemes that cut
the cache (hybrids, latent attention) beside rope.

A hybrid's local layers read at most their window however long the context, and latent attention reads
0.31x rope's bytes a token, so their decode steps should fall behind rope's less as the context grows; the
section prints that as a ratio measured in the same run (`rnope-swa / rope  0.xx`, `mla / rope  0.xx`),
never as an absolute time, then what decoupled RoPE saves latent attention (bench/latent.py).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from bench.latent import print_absorbed_step
from bench.runners import batch_runner, step_seconds
from contract.manifest import Manifest
from service.engine.worker.runner import ModelRunner

LONG_CONTEXTS = (256, 1024, 4096)  # tokens of context the decode step reads
BASELINE = "rope"
ROUNDS = 5  # each model at each context once a round, the order rotated


def long_context_steps(
    folders: list[Path], args: argparse.Namespace, steps: int, rounds: int = ROUNDS
) -> dict[str, dict[int, float]]:
    """Median decode step seconds (batch 1, the served default graph) per model and context: each
    round times every model at every context (`steps` steps, their median), in an order rotated by
    round so that a slow spell of the shared machine falls on all of them; the figure is the rounds'
    median. A context at or past a model's position limit is left out."""
    runners: dict[str, dict[int, ModelRunner]] = {}
    for folder in folders:
        manifest = Manifest.load(folder)
        if not manifest.served_by_default:
            continue
        runners[manifest.name] = {
            context: batch_runner(folder, 1, context, args.threads, args.device)
            for context in LONG_CONTEXTS
            if manifest.max_positions is None or context < manifest.max_positions
        }
    names = list(runners)
    samples: dict[str, dict[int, list[float]]] = {name: {c: [] for c in runners[name]} for name in names}
    for round_index in range(rounds):
        for name in names[round_index % len(names):] + names[: round_index % len(names)]:
            for context, runner in runners[name].items():
                samples[name][context].append(step_seconds(runner, steps))
    return {name: {c: statistics.median(v) for c, v in by_context.items()} for name, by_context in samples.items()}


def cuts_the_cache(manifest: Manifest) -> bool:
    """A model that caches less than K and V of every layer a token: a hybrid's windows, or latent attention."""
    return manifest.is_hybrid or not manifest.kv_spec.key_value


def hybrid_ratios(table: dict[str, dict[int, float]], context: int, names: set[str]) -> dict[str, float]:
    """The step time over rope's at `context` of each model in `names` (those that cut the cache), where both ran."""
    base = table.get(BASELINE, {}).get(context)
    if base is None:
        return {}
    return {name: row[context] / base for name, row in table.items() if name in names and context in row}


def print_long_context(folders: list[Path], args: argparse.Namespace, steps: int) -> None:
    """Print the inter-token latency table (ms, median of `steps` decode steps) and each hybrid's
    ratio to rope at every context."""
    print(
        f"\nInter-token latency at long context (ms; per round the median of {steps} decode steps, batch 1, "
        f"{args.threads} intra-op thread(s); the median of {ROUNDS} rounds, schemes rotated):"
    )
    table = long_context_steps(folders, args, steps)
    print("  " + f"{'model':<12}" + "".join(f"{c:>10}" for c in LONG_CONTEXTS))
    for name, row in table.items():
        cells = "".join(f"{row[c] * 1000:10.2f}" if c in row else f"{'-':>10}" for c in LONG_CONTEXTS)
        print(f"  {name:<12}{cells}")
    cutting = {Manifest.load(folder).name for folder in folders if cuts_the_cache(Manifest.load(folder))}
    for context in LONG_CONTEXTS:
        for name, ratio in hybrid_ratios(table, context, cutting).items():
            print(f"  {name} / {BASELINE}  {ratio:.2f}   (at {context} tokens of context)")
    print_absorbed_step(folders, LONG_CONTEXTS, args.threads, steps)
