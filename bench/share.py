"""The share section: how much of a decode step goes to handling the KV cache."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import onnxruntime as ort

from bench.runners import batch_runner, planned_step, step_seconds


def print_cache_share(folder: Path, args: argparse.Namespace, steps: int) -> None:
    """Print the share section for one model, batch 8 at context 2048."""
    print("\nCache handling share of decode step time, batch 8, context 2048 (goal <= 20%):")
    share = cache_share(folder, 8, 2048, args.threads, steps, args.device)
    print(
        f"  {'KV store, in-place serving graph':<34} step {share['step_ms']:7.2f} ms   store writes "
        f"{share['host_cache_ms']:6.2f} ms   KV Concat {share['kv_concat_ms']:6.2f} ms   "
        f"share {share['share'] * 100:5.1f}%"
    )


def cache_share(
    folder: Path, batch: int, context: int, threads: int, steps: int, device: str = "cpu"
) -> dict[str, float]:
    """Share of decode step time spent on the cache: the store's writes on the engine thread plus
    in-graph KV Concat kernels (none in the in-place serving graph; counted to show it).

    Step time and store writes come from an unprofiled run; the Concat share of kernel time
    from a profiled one (profiling slows every kernel alike), scaled to the graph's share.
    """
    runner = batch_runner(folder, batch, context, threads, device)
    step = step_seconds(runner, steps)
    decode = planned_step(runner)
    runner.timings.graph = runner.timings.cache = 0.0
    for _ in range(steps):
        decode()
        runner.store.rewind(1)
    host, graph = runner.timings.cache / steps, runner.timings.graph / steps

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.intra_op_num_threads = threads
    options.profile_file_prefix = str(Path(tempfile.gettempdir()) / "posenc-profile")
    path = str(runner.manifest.onnx_path(runner.variant))
    profiled = ort.InferenceSession(path, options, providers=runner.providers)
    runner.session.session = profiled
    runner.forget_calls(everything=True)  # bind the profiled session
    decode = planned_step(runner)
    for _ in range(steps):
        decode()
        runner.store.rewind(1)
    profile_path = Path(profiled.end_profiling())
    kernel_all = kernel_concat = 0.0
    cache_bytes = batch * context * runner.manifest.n_heads * runner.manifest.head_dim * 4
    for event in json.loads(profile_path.read_text()):
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        kernel_all += event["dur"]
        args = event.get("args", {})
        # A Concat whose output is a whole K or V cache (not a small score tensor).
        if args.get("op_name") == "Concat" and int(args.get("output_size", 0)) >= cache_bytes:
            kernel_concat += event["dur"]
    profile_path.unlink(missing_ok=True)
    concat = graph * kernel_concat / kernel_all if kernel_all else 0.0
    return {
        "step_ms": step * 1000,
        "host_cache_ms": host * 1000,
        "kv_concat_ms": concat * 1000,
        "share": (host + concat) / step,
    }
