"""The fused section: the explicit in-place serving graph against the fused GroupQueryAttention one."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.runners import CONTEXTS, batch_runner, step_seconds
from contract.manifest import Manifest


def print_fused_steps(folders: list[Path], args: argparse.Namespace, steps: int) -> None:
    """Decode step time of the explicit in-place serving graph against the fused one (one
    GroupQueryAttention kernel per layer, export/fused.py) on the same full rows, per context."""
    contexts = CONTEXTS[::2] if args.quick else CONTEXTS
    print(
        f"\nDecode step time (ms, median of {steps}), explicit serving graph / fused GroupQueryAttention graph "
        f"(speed-up), full cache, {args.threads} intra-op thread(s):"
    )
    print("  " + f"{'model':<12}{'batch':>6}" + "".join(f"{c:>24}" for c in contexts))
    for folder in folders:
        manifest = Manifest.load(folder)
        if not manifest.served_by_default or manifest.fused_attention is None:
            continue
        for batch in (1, 8):
            cells = []
            for context in contexts:
                if manifest.max_positions is not None and context >= manifest.max_positions:
                    cells.append(f"{'not servable':>24}")
                    continue
                explicit, fused = (
                    step_seconds(batch_runner(folder, batch, context, args.threads, args.device, "auto", mode), steps)
                    for mode in ("explicit", "fused")
                )
                cells.append(f"{explicit * 1000:7.2f} /{fused * 1000:7.2f} ({explicit / fused:4.2f}x)")
            print(f"  {manifest.name:<12}{batch:>6}" + "".join(cells))
