"""Build the model repository: `python -m export`.

For every scheme with shipped weights (and, with --seeds, every further training seed of it,
models/weights/seed<N>/<scheme>, as `<scheme>@seed<N>`): export the graphs this device serves with a KV cache
(float32, its in-place serving graph, the int8 cache's serving graph and the fused decode graph of
export/fused.py; float16 ones too where CUDA ONNX Runtime is installed, or with --fp16), models side
by side in --workers processes, write manifest.json and genai_config.json, check parity and print an
evaluation table. The work itself is `export.repository`; this is its command line.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from contract.cli import HelpFormatter
from contract.manifest import (
    PREFILL_FUSED,
    PREFILL_UP_PROJECTED,
    SERVING,
    SERVING_FP16,
    SERVING_FUSED,
    SERVING_FUSED_INT8,
    SERVING_INT8,
)
from contract.paths import sized_repository
from export.repository import GRAPH_FILES, ExportOptions, ExportResult, plan, run
from models.positional import SCHEMES
from models.sizes import RANDOM_SCHEMES, RANDOM_SEED, RANDOM_SIZES

# Short names of the graph variants for the table's size column.
SHORT_NAMES = {
    "float32": "fp32",
    SERVING: "serving",
    "float16": "fp16",
    SERVING_FP16: "serving-fp16",
    SERVING_INT8: "int8",
    SERVING_FUSED: "fused",
    PREFILL_FUSED: "prefill",
    SERVING_FUSED_INT8: "fused-int8",
    PREFILL_UP_PROJECTED: "prefill-up",
}


def format_table(results: list[ExportResult], contexts: tuple[int, ...]) -> str:
    sizes = "/".join(SHORT_NAMES[v] for v in results[0].onnx_bytes) if results else ""
    header = ["model", "params", "val bpb@256"] + [f"test bpb@{c}" for c in contexts]
    # fp32 limit: what the float32 graphs are held to (FP32_TOLERANCE, or twice PyTorch's own rounding).
    # parity fused-int8: against PyTorch quantizing the same way (held to INT8_CHANNEL_TOLERANCE: rounding ties).
    header += ["parity fp32", "parity fp16", "parity fused", "parity prefill", "parity fused-int8", "cached=full"]
    header += ["fp32 limit"]
    header += [f"onnx MB {sizes}"]
    header += ["export s"]
    rows = [header]

    def fmt(value: float | None, digits: int = 3) -> str:
        return "not servable" if value is None else f"{value:.{digits}f}"

    for r in results:
        parity = {p.dtype: p for p in r.parity}
        cached = parity["float32"].cached_vs_full_max_abs if "float32" in parity else None
        rows.append(
            [
                r.name,
                f"{r.parameters:,}",
                "-" if r.val_bpb is None else fmt(r.val_bpb),  # none recorded: random weights
                *[fmt(r.test_bpb.get(c)) if c in r.test_bpb else "-" for c in contexts],
                f"{parity['float32'].max_abs:.1e}" if "float32" in parity else "-",
                f"{parity['float16'].max_abs:.1e}" if "float16" in parity else "-",
                f"{r.fused_max_abs:.1e}" if r.fused_max_abs is not None else "-",
                f"{r.prefill_max_abs:.1e}" if r.prefill_max_abs is not None else "-",
                f"{r.fused_int8_max_abs:.1e}" if r.fused_int8_max_abs is not None else "-",
                f"{cached:.1e}" if cached is not None else "-",
                f"{r.float32_limit:.1e}" if r.parity else "-",
                "/".join(f"{size / 1e6:.1f}" for size in r.onnx_bytes.values()),
                f"{r.export_seconds:.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> ExportOptions:
    defaults = ExportOptions()
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--weights", type=Path, default=defaults.weights, help="folder of trained weights per scheme")
    parser.add_argument(
        "--out", type=Path, default=None,
        help=f"model repository to write (default: {defaults.out.name}; with --size S: {sized_repository('S').name})",
    )  # fmt: skip
    parser.add_argument(
        "--schemes", nargs="+", choices=SCHEMES, default=None, metavar="SCHEME",
        help=f"schemes to export, from {', '.join(SCHEMES)} (default: every one with weights in --weights)",
    )  # fmt: skip
    graphs = parser.add_mutually_exclusive_group()
    graphs.add_argument(
        "--fp16", action=argparse.BooleanOptionalAction, default=None,
        help="float16 graphs (float16, serving-float16) too; default: only where CUDA ONNX Runtime is installed",
    )  # fmt: skip
    graphs.add_argument(
        "--graphs", nargs="+", choices=list(GRAPH_FILES), default=None, metavar="VARIANT",
        help=f"exactly these graph variants (float32 always), from {', '.join(GRAPH_FILES)}",
    )  # fmt: skip
    parser.add_argument(
        "--rope-scaling", nargs="*", default=[], metavar="KIND:FACTOR",
        help="extra rope models with inference-time scaling, e.g. ntk:4 yarn:8 linear:2",
    )  # fmt: skip
    parser.add_argument(
        "--seeds", "--extra-seeds", dest="extra_seeds", action=argparse.BooleanOptionalAction, default=False,
        help="also export every further training seed found (weights/seed<N>/<scheme>, as <scheme>@seed<N>, served "
        "only when named); by default only each scheme's served seed: `python -m loadtest.compare` exports the "
        "further seeds it scores itself",
    )  # fmt: skip
    parser.add_argument(
        "--size", choices=RANDOM_SIZES, default=None,
        help="random weights from a fixed seed at this size (models/sizes.py; small: 12 x 768, GPT-2 small's shape) "
        f"instead of the trained ones; default schemes {' '.join(RANDOM_SCHEMES)}, graphs the service needs; "
        "export into a folder outside git (--out)",
    )  # fmt: skip
    parser.add_argument(
        "--n-layers", type=int, default=None, help="with --size: this many layers (a shallower stand-in, same width)"
    )
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip parity and evaluation")
    parser.add_argument(
        "--eval-windows", type=int, default=defaults.eval_windows, help="test-split windows per evaluated context"
    )
    parser.add_argument(
        "--eval-contexts", type=int, nargs="+", default=list(defaults.eval_contexts), metavar="BYTES",
        help="contexts (bytes) the evaluation table measures bits per byte at",
    )  # fmt: skip
    parser.add_argument(
        "--corpus", type=Path, default=None, help="evaluation text file or folder (default: the stdlib's test split)"
    )
    parser.add_argument(
        "--workers", type=int, default=defaults.workers,
        help="processes exporting models side by side (0: one per available core, at most one per model)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    return ExportOptions(
        weights=args.weights,
        out=args.out or (defaults.out if args.size is None else sized_repository(args.size)),
        schemes=None if args.schemes is None else tuple(args.schemes),
        fp16=args.fp16,
        graphs=None if args.graphs is None else tuple(args.graphs),
        rope_scaling=tuple(args.rope_scaling),
        verify=args.verify,
        eval_windows=args.eval_windows,
        eval_contexts=tuple(args.eval_contexts),
        corpus=args.corpus,
        workers=args.workers,
        extra_seeds=args.extra_seeds and args.size is None,
        size=args.size,
        n_layers=args.n_layers,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    options = parse_args(argv)
    started = time.time()
    print(plan(options), flush=True)
    results = run(options)
    print(format_table(results, options.eval_contexts if options.verify and options.size is None else ()))
    if options.size is not None:
        print(f"\nsize {options.size}: RANDOM weights (seed {RANDOM_SEED}): for latency, memory and capacity, not text")
    print(f"\nmodel repository: {options.out}  ({time.time() - started:.0f} s in all)")
    failures = [failure for r in results for failure in r.parity_failures()]
    if failures:
        print(f"parity FAILED for: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
