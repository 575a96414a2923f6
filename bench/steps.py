"""The steps section: decode step time versus context length, per scheme, batch 1 and 8."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.runners import CONTEXTS, batch_runner, step_seconds
from contract.manifest import Manifest


def print_step_table(folders: list[Path], args: argparse.Namespace, steps: int) -> None:
    """Print one row per model: median step time per context, batch 1 / batch 8 (contexts at or past
    a model's position limit are marked not servable)."""
    contexts = CONTEXTS[::2] if args.quick else CONTEXTS
    print("\nDecode step time (ms, median) versus context length, batch 1 / batch 8:")
    print("  " + f"{'model':<12}" + "".join(f"{c:>16}" for c in contexts))
    for folder in folders:
        manifest = Manifest.load(folder)
        cells = []
        for context in contexts:
            if manifest.max_positions is not None and context >= manifest.max_positions:
                cells.append(f"{'not servable':>16}")
                continue
            one = step_seconds(batch_runner(folder, 1, context, args.threads, args.device), steps) * 1000
            eight = step_seconds(batch_runner(folder, 8, context, args.threads, args.device), steps) * 1000
            cells.append(f"{one:7.2f} /{eight:7.2f}")
        print(f"  {manifest.name:<12}" + "".join(cells))
