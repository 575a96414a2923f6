"""Serving benchmark, measured side by side in one run: `python -m bench`.

Prints single-stream decode tokens/s through gRPC versus an in-process ONNX Runtime loop and
onnxruntime-genai on the same ONNX files; aggregate tokens/s at several concurrencies; decode
step time versus context length per scheme; the share of step time spent handling the KV
cache; KV bytes per token; and time to first token against the prompt's arithmetic and
onnxruntime-genai's prompt phase; and inter-token latency at 256-4,096 tokens of context, each
hybrid beside rope (`--sections long-context`). Figures, not verdicts: ratios are computed within the run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.fused import print_fused_steps
from bench.long_context import BASELINE, print_long_context
from bench.mixed import print_mixed_lengths
from bench.policies import print_int8_ratio, print_policy_steps
from bench.prefill import print_prefill
from bench.share import print_cache_share
from bench.speculative import print_speculative
from bench.steps import print_step_table
from bench.throughput import print_throughput
from bench.width import SCHEMES as WIDTH_SCHEMES
from bench.width import print_width
from contract.cli import HelpFormatter
from contract.manifest import Manifest
from contract.paths import REPOSITORY_ROOT, sized_repository
from models.sizes import RANDOM_SIZES
from service.engine.messages import EngineConfig
from service.engine.worker import denormals
from service.engine.worker.model_session import default_threads, serving_plan

SECTIONS = ("mixed", "throughput", "steps", "share", "policies", "fused", "prefill", "speculative", "long-context")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--model-repository", type=Path, default=REPOSITORY_ROOT / "model_repository",
        help="model repository to serve (written by python -m export)",
    )  # fmt: skip
    parser.add_argument("--model", default="alibi", help="model for the single-stream and concurrency figures")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per session (0: half the cores)")
    parser.add_argument(
        "--new-tokens", type=int, default=256, help="tokens per single-stream request (the concurrency runs use half)"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 16, 64], metavar="STREAMS",
        help="concurrent streams the aggregate throughput is measured at",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer steps and contexts")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="rounds of the throughput section (single stream: every layer once, medians of three runs; "
        "aggregate: one sweep over every concurrency); figures and ratios are their medians",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the service and runners run")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
        help=f"which parts to run, from {' '.join(SECTIONS)}",
    )  # fmt: skip
    parser.add_argument(
        "--size", choices=RANDOM_SIZES, default=None,
        help="instead of the sections: every scheme at this size (random weights, python -m export --size) against "
        "the memory-bandwidth roofline, genai, GEMM and sgemm (bench/width.py); repository default "
        f"{sized_repository('SIZE').name}",
    )  # fmt: skip
    parser.add_argument(
        "--schemes", nargs="+", default=list(WIDTH_SCHEMES), metavar="SCHEME",
        help=f"with --size: the schemes measured, {BASELINE} among them (default: {' '.join(WIDTH_SCHEMES)})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.size is not None and BASELINE not in args.schemes:
        parser.error(f"--schemes must include {BASELINE}: every ratio of --size is taken against it")
    denormals.enable()  # as the engine core does: the in-process figures run the served settings
    repository: Path = args.model_repository
    server_threads = args.threads  # 0: the server's own default (decode half the cores, prefill all)
    args.threads = args.threads or default_threads()  # decode threads, for the in-process figures
    if args.size is not None:
        default = parser.get_default("model_repository")
        print_width(args, sized_repository(args.size) if repository == default else repository, server_threads)
        return 0
    # Further training seeds (rope@seed2) have their scheme's graphs: nothing of their own to time.
    folders = sorted(
        p for p in repository.iterdir() if (p / "manifest.json").is_file() and not Manifest.load(p).is_extra_seed
    )
    steps = 5 if args.quick else 20

    print_kv_bytes(folders, args.device)
    device_flags = ["--device", args.device]
    if "mixed" in args.sections:
        print_mixed_lengths(repository, args.model, server_threads, device_flags, args.quick)
    if "throughput" in args.sections:
        print_throughput(args, repository, server_threads, device_flags, steps)
    if "steps" in args.sections:
        print_step_table(folders, args, steps)
    if "share" in args.sections:
        print_cache_share(repository / args.model, args, steps)
    if "policies" in args.sections:
        print_policy_steps(folders, args, steps)
        print_int8_ratio(folders, args, steps)
    if "fused" in args.sections:
        print_fused_steps(folders, args, steps)
    if "prefill" in args.sections:
        print_prefill(args, repository, server_threads, device_flags)
    if "speculative" in args.sections:
        print_speculative(args, repository, server_threads, device_flags)
    if "long-context" in args.sections:
        print_long_context(folders, args, 10 if args.quick else 50)  # short steps: more of them
    return 0


def print_kv_bytes(folders: list[Path], device: str) -> None:
    """The header every run prints, whatever its sections: the KV bytes a row holds and the position
    limit per model, on the layout the server gives it on `device` (a split hybrid's row holds its
    global layers' K/V a token and a fixed part for its local layers, not whole tokens)."""
    print("KV bytes of a row as served (K and V a token; a split hybrid's local layers a sequence):")
    block_size = EngineConfig().block_size
    for folder in folders:
        manifest = Manifest.load(folder)
        layout = serving_plan(manifest, device, "auto", block_size).layout
        per_sequence = f" + {layout.local_row_bytes} B/sequence" if layout.split else ""
        limit = manifest.max_positions or "unbounded"
        print(f"  {manifest.name:<12} {layout.token_bytes:>6} B/token{per_sequence}   positions: {limit}")

if __name__ == "__main__":
    raise SystemExit(main())
