"""The policies section: decode step time and KV bytes per sequence under each cache policy."""

from __future__ import annotations

import argparse
import logging
import statistics
from pathlib import Path

from bench.runners import bounded_step_seconds, policy_runner, step_seconds
from contract.cache_policy import parse_cache_policy
from contract.manifest import Manifest

POLICY_HISTORY = 2048  # tokens a sequence has seen when its step time per cache policy is measured
INT8_ROUNDS = 5  # the int8 / full ratio: rounds of the two runners alternated (the machine drifts)
BENCH_POLICIES = ("full", "window:256", "sinks:4+window:252", "window:64", "int8", "window:256+int8")
logger = logging.getLogger(__name__)


def print_policy_steps(folders: list[Path], args: argparse.Namespace, steps: int) -> None:
    """Decode step time per cache policy at POLICY_HISTORY tokens of history, batch 1 and 8."""
    print(
        f"\nDecode step time (ms, median, batch 1 / batch 8) per cache policy after {POLICY_HISTORY} tokens of "
        "history, and KV bytes per sequence (a bounded row evicts and appends one token per step):"
    )
    names = list(BENCH_POLICIES)
    print("  " + f"{'model':<12}" + "".join(f"{p:>22}" for p in names))
    for folder in folders:
        manifest = Manifest.load(folder)
        if not manifest.served_by_default:
            continue
        cells = []
        for text in names:
            policy = parse_cache_policy(text)
            if manifest.max_positions is not None and POLICY_HISTORY >= manifest.max_positions:
                cells.append(f"{'not servable':>22}")
                continue
            if policy.missing(manifest) is not None:  # a form the service refuses for this model (a hybrid's)
                cells.append(f"{'refused':>22}")
                continue
            try:
                one = policy_runner(folder, 1, POLICY_HISTORY, policy, args.threads, args.device)
            except (AssertionError, ValueError) as error:  # an export without this policy
                cells.append(f"{'n/a':>22}")
                logger.debug("%s %s: %s", manifest.name, text, error)
                continue
            eight = policy_runner(folder, 8, POLICY_HISTORY, policy, args.threads, args.device)
            timing = step_seconds if policy.budget is None else bounded_step_seconds
            per_sequence = one.store.stats().physical_bytes
            cells.append(
                f"{timing(one, steps) * 1000:6.2f} /{timing(eight, steps) * 1000:6.2f} {per_sequence / 1e6:5.2f}MB"
            )
        print(f"  {manifest.name:<12}" + "".join(cells))


def print_int8_ratio(folders: list[Path], args: argparse.Namespace, steps: int) -> None:
    """int8 / full decode step time at POLICY_HISTORY, batch 1 and 8: the two runners' steps timed in
    alternation, INT8_ROUNDS rounds, the median of the rounds' ratios (issue 35's goal: <= 0.8)."""
    print(f"\nint8 / full decode step after {POLICY_HISTORY} tokens (median of {INT8_ROUNDS} alternated rounds):")
    full, int8 = parse_cache_policy("full"), parse_cache_policy("int8")
    for folder in folders:
        manifest = Manifest.load(folder)
        if not manifest.served_by_default or int8.missing(manifest) is not None:
            continue
        if manifest.max_positions is not None and POLICY_HISTORY >= manifest.max_positions:
            continue
        cells = []
        for batch in (1, 8):
            runners = [policy_runner(folder, batch, POLICY_HISTORY, p, args.threads, args.device) for p in (full, int8)]
            count = max(10, 3 * steps // batch)
            ratios = []
            for _ in range(INT8_ROUNDS):
                base, quantized = (step_seconds(runner, count) for runner in runners)
                ratios.append(quantized / base)
            kind = next(runners[1].store.batches()).kind
            cells.append(f"batch {batch} {statistics.median(ratios):.2f}")
        print(f"  {manifest.name:<12} " + ", ".join(cells) + f"  (int8 rows: {kind})")
