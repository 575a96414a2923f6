"""`python -m bench --size small`: every scheme at a realistic width, held against the physical limit.

A decode step at GPT-2 small's width reads every weight and the cached K/V it attends to once, so
one stream cannot decode faster than memory bandwidth over those bytes (the roofline). This run
measures the bandwidth itself (a read of a buffer larger than the last-level cache, in this
process, on as many threads as decoding uses) and holds each figure against a limit measured in
the same run: decode through gRPC against the roofline and against onnxruntime-genai, decode at
long context against each scheme's own roofline there, aggregate decode against ONNX Runtime's
own matrix products at that batch, a 2 KB prompt against the same products at its rows. The
weights are random (`python -m export --size small`): latency, memory and capacity do not need
trained ones. Figures, not verdicts: every ratio is taken within the run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from bench.layers import decode_tokens_per_second_genai, decode_tokens_per_second_grpc_counted
from bench.long_context import BASELINE, LONG_CONTEXTS, hybrid_ratios
from bench.prefill import gemm_gflops, grpc_ttft, linear_shapes, prefill_flops, prompt_text
from bench.runners import batch_runner, step_seconds
from bench.streams import median_of
from bench.throughput import aggregate_tokens_per_second
from contract.manifest import Manifest
from export.fused import IR_VERSION
from models.sizes import RANDOM_SCHEMES
from service.engine.messages import EngineConfig
from service.engine.worker.model_session import serving_plan
from service.process import ServerProcess

BANDWIDTH_BUFFER = 1 << 28  # 256 MiB: eight times this machine's 32 MiB last-level cache
BUDGET = 1 << 30  # the cache memory the capacity column fills: 1 GiB
LONG = LONG_CONTEXTS[-1]  # the context of the decode@4096 and ITL@4096 lines
PROMPT_BYTES = 2048
STREAMS = (16, 64)
# The schemes measured, the baseline first (mla joins RANDOM_SCHEMES once export has its graphs).
SCHEMES = RANDOM_SCHEMES


def read_bandwidth(threads: int, size: int = BANDWIDTH_BUFFER, runs: int = 5) -> float:
    """Bytes/s of a read of a `size`-byte buffer split over `threads` threads (numpy's reductions
    release the GIL), best of `runs`: the rate decode's weight and K/V reads cannot beat."""
    buffer = np.ones(size // 8, dtype=np.float64)
    parts = np.array_split(buffer, threads)
    with ThreadPoolExecutor(threads) as pool:

        def once() -> float:
            started = time.perf_counter()
            list(pool.map(np.sum, parts))
            return time.perf_counter() - started

        once()  # touch every page first
        return size / min(once() for _ in range(runs))


def weight_bytes(manifest: Manifest) -> int:
    """Bytes of weights a decode step reads: every float32 parameter (the embedding's one row is the
    exception, and at 259 x 768 it is 0.2% of the model)."""
    return 4 * int(manifest.data["parameters"])  # type: ignore[call-overload]


def kv_read_bytes(manifest: Manifest, context: int) -> int:
    """K/V bytes a step reads at `context` tokens, as the server lays the row out: every layer's K and
    V a token, or a split hybrid's global layers' a token plus its local layers' window."""
    layout = serving_plan(manifest, "cpu", "auto", EngineConfig().block_size).layout
    return layout.token_bytes * context + layout.local_row_bytes


def roofline(bandwidth: float, manifest: Manifest, context: int) -> float:
    """Tokens/s one stream can reach at `context`: bandwidth over the bytes a step reads."""
    return bandwidth / (weight_bytes(manifest) + kv_read_bytes(manifest, context))


def gemm_ceiling(manifest: Manifest, rows: int, threads: int, runs: int = 5) -> float:
    """Tokens/s of a decode step's matrix products alone at `rows` streams, by ONNX Runtime's own
    MatMul kernels on `threads` threads with the model's weight shapes (random, so they stream from
    memory as the model's do): what aggregate decode at that batch cannot beat."""
    shapes = linear_shapes(manifest, rows)
    rng = np.random.default_rng(0)
    nodes, inputs, outputs, weights = [], [], [], []
    for i, (m, k, n) in enumerate(shapes):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [m, k]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [m, n]))
        weights.append(numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"y{i}"]))
    graph = helper.make_graph(nodes, "gemm_ceiling", inputs, outputs, weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {f"x{i}": rng.standard_normal((m, k)).astype(np.float32) for i, (m, k, _) in enumerate(shapes)}
    session.run(None, feeds)  # warm-up
    best = min(_seconds(lambda: session.run(None, feeds)) for _ in range(runs))
    return rows / best


def _seconds(call: object) -> float:
    started = time.perf_counter()
    call()  # type: ignore[operator]
    return time.perf_counter() - started


def small_folders(repository: Path, schemes: tuple[str, ...]) -> list[Path]:
    """The exported folder of every scheme asked, in the order asked; a missing one stops the run, named."""
    folders = []
    for scheme in schemes:
        folder = repository / scheme
        if not (folder / "manifest.json").is_file():
            raise SystemExit(f"{folder}: no model; export it with python -m export --size small --out {repository}")
        folders.append(folder)
    return folders


def print_header(folders: list[Path], bandwidth: float, threads: int) -> None:
    """The size, parameters, weight bytes and bandwidth, then K/V bytes a token and 4,096-token requests a GiB."""
    manifest = Manifest.load(folders[0])
    parameters = int(manifest.data["parameters"])  # type: ignore[call-overload]
    random = "RANDOM weights (seed-fixed, not trained)" if manifest.random_weights else "trained weights"
    print(
        f"size {manifest.size}: {manifest.n_layers} layers x {manifest.data['d_model']} wide, {manifest.n_heads} "
        f"heads, {random}; {parameters / 1e6:.1f}M parameters; weights {weight_bytes(manifest) / 1e6:.0f} MB; "
        f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (a {BANDWIDTH_BUFFER >> 20} MiB read, {threads} thread(s))"
    )
    print(f"\nK/V a token and {LONG}-token requests in a {BUDGET >> 30} GiB cache budget:")
    for folder in folders:
        manifest = Manifest.load(folder)
        layout = serving_plan(manifest, "cpu", "auto", EngineConfig().block_size).layout
        local = f" + {layout.local_row_bytes / 1e6:.1f} MB a sequence" if layout.split else ""
        fits = BUDGET // kv_read_bytes(manifest, LONG)
        print(f"  {manifest.name:<12} {layout.token_bytes / 1024:6.1f} KB/token{local:<24} {fits:4d} requests")


def serve_figures(folder: Path, args: argparse.Namespace, server_threads: int, new_tokens: int) -> dict[str, float]:
    """Through gRPC, one server for this model alone (at 85 M parameters each served model holds
    its graphs' weights): one stream's decode tokens/s, a 2 KB prompt's time to first token, and
    for the baseline the aggregate tokens/s at STREAMS and onnxruntime-genai alternated with gRPC."""
    name = Manifest.load(folder).name
    server = ServerProcess(folder.parent, "--models", name, "--max-new-tokens-limit", "4096",
                           "--device", args.device, threads=server_threads)  # fmt: skip
    figures: dict[str, float] = {}
    salt = iter(range(10**9))
    try:
        server.wait_serving(timeout=600)
        decode_tokens_per_second_grpc_counted(server, name, 8)  # warm-up
        grpc_ttft(server, name, prompt_text(300, next(salt)))
        grpc, genai = [], []
        for _ in range(1 if args.quick else 3):  # gRPC and genai alternated: the machine drifts
            grpc.append(median_of(lambda: decode_tokens_per_second_grpc_counted(server, name, new_tokens)))
            if name == BASELINE:
                rate = decode_tokens_per_second_genai(folder, new_tokens, args.threads)
                genai.append(float("nan") if rate is None else rate)
        figures["grpc"] = statistics.median(grpc)
        if genai:
            figures["genai"] = statistics.median(genai)
        runs = 1 if args.quick else 3
        figures["ttft"] = statistics.median(
            grpc_ttft(server, name, prompt_text(PROMPT_BYTES, next(salt))) for _ in range(runs)
        )
        if name == BASELINE:
            for streams in STREAMS:
                figures[f"streams{streams}"] = aggregate_tokens_per_second(
                    server, name, streams, new_tokens // 4, requests_per_stream=1
                )
    finally:
        server.stop()
    return figures


def context_steps(folder: Path, args: argparse.Namespace, steps: int) -> dict[int, float]:
    """Median decode step seconds (batch 1, random K/V) at each of LONG_CONTEXTS, one runner at a
    time (each holds the model's sessions: at this width they do not all fit side by side)."""
    times = {}
    for context in LONG_CONTEXTS:
        runner = batch_runner(folder, 1, context, args.threads, args.device)
        times[context] = step_seconds(runner, steps)
        del runner
    return times


def print_width(args: argparse.Namespace, repository: Path, server_threads: int) -> None:
    """The whole `--size` run: header, per-scheme table, aggregate and prefill, then the ratio lines."""
    folders = small_folders(repository, (BASELINE, *(s for s in args.schemes if s != BASELINE)))
    bandwidth = read_bandwidth(args.threads)
    print_header(folders, bandwidth, args.threads)
    new_tokens = 64 if args.quick else 128
    steps = 5 if args.quick else 20
    serving = {f.name: serve_figures(f, args, server_threads, new_tokens) for f in folders}
    itl = {f.name: context_steps(f, args, steps) for f in folders}
    manifests = {f.name: Manifest.load(f) for f in folders}
    short = short_context(new_tokens)
    print_table(manifests, serving, itl, bandwidth, (new_tokens, args.threads, steps))
    base = manifests[BASELINE]
    print_aggregate(serving[BASELINE], base, args.threads, bandwidth)
    sgemm = gemm_gflops(linear_shapes(base, PROMPT_BYTES + 1))
    print(f"\n{PROMPT_BYTES}-byte prompt through gRPC ({os.cpu_count()} prefill threads): time to first token, and the "
          f"prompt's FLOPs / TTFT against numpy's sgemm over the same linear layers at {PROMPT_BYTES + 1} rows "
          f"({sgemm:.1f} GFLOP/s in this run):")  # fmt: skip
    for name, manifest in manifests.items():
        rate = prefill_flops(manifest, PROMPT_BYTES + 1) / serving[name]["ttft"] / 1e9
        print(f"  {name:<12}{serving[name]['ttft'] * 1000:10.0f} ms {rate:8.1f} GFLOP/s")
    print()
    for name, manifest in manifests.items():
        print(f"{name} decode/roofline {serving[name]['grpc'] / roofline(bandwidth, manifest, short):.2f}")
    for name, manifest in manifests.items():
        print(f"{name} decode@{LONG}/roofline {1 / itl[name][LONG] / roofline(bandwidth, manifest, LONG):.2f}")
    print(f"gRPC/genai {serving[BASELINE]['grpc'] / serving[BASELINE].get('genai', float('nan')):.2f}")
    rate = prefill_flops(base, PROMPT_BYTES + 1) / serving[BASELINE]["ttft"] / 1e9
    print(f"prefill/sgemm {rate / sgemm:.2f}")
    for name, ratio in hybrid_ratios(itl, LONG).items():
        print(f"{name} / {BASELINE} ITL@{LONG} {ratio:.2f}")
    print(f"\n(at 16 streams of {LONG} tokens a step reads the weights once and 16 rows of K/V: by the roofline a "
          "hybrid's step is then " + ", ".join(
              f"{name} {batch_step_bytes(manifest, 16) / batch_step_bytes(base, 16):.2f}"
              for name, manifest in manifests.items() if name.endswith("-swa")) + f" of {BASELINE}'s)")  # fmt: skip


def batch_step_bytes(manifest: Manifest, rows: int) -> int:
    """Bytes a decode step of `rows` rows of LONG tokens reads: the weights once, every row's K/V."""
    return weight_bytes(manifest) + rows * kv_read_bytes(manifest, LONG)


def short_context(new_tokens: int) -> int:
    """The mean context of the one-stream runs: the prompt ("def main():\\n" and BOS) and half the tokens."""
    return 13 + new_tokens // 2


def print_table(
    manifests: dict[str, Manifest],
    serving: dict[str, dict[str, float]],
    itl: dict[str, dict[int, float]],
    bandwidth: float,
    run: tuple[int, int, int],
) -> None:
    """One row per scheme: gRPC decode and its roofline, inter-token latency per context and its roofline."""
    new_tokens, threads, steps = run
    print(
        f"\nOne stream through gRPC ({new_tokens} tokens, {threads} decode thread(s)) and inter-token latency "
        f"(runner, batch 1, median of {steps} steps), each against its roofline (bandwidth / bytes a step reads):"
    )
    header = "".join(f"{f'ITL@{c} ms':>14}" for c in LONG_CONTEXTS) + "".join(
        f"{f'roof@{c}':>12}" for c in LONG_CONTEXTS
    )
    print("  " + f"{'model':<12}{'tokens/s':>10}{'roofline':>10}" + header)
    for name, manifest in manifests.items():
        cells = "".join(f"{itl[name][c] * 1000:14.1f}" for c in LONG_CONTEXTS)
        roofs = "".join(f"{1000 / roofline(bandwidth, manifest, c):12.1f}" for c in LONG_CONTEXTS)
        limit = roofline(bandwidth, manifest, short_context(new_tokens))
        print(f"  {name:<12}{serving[name]['grpc']:10.1f}{limit:10.1f}{cells}{roofs}")


def print_aggregate(figures: dict[str, float], manifest: Manifest, threads: int, bandwidth: float) -> None:
    """Aggregate tokens/s at each of STREAMS against ONNX Runtime's matrix products at that batch
    (gemm_ceiling), and what the roofline makes of a hybrid beside rope at 16 streams of LONG tokens."""
    print(f"\nAggregate decode through gRPC ({BASELINE}, one request a stream) against the decode step's matrix "
          f"products alone at that batch (ONNX Runtime MatMul, {threads} thread(s)):")  # fmt: skip
    for streams in STREAMS:
        ceiling = gemm_ceiling(manifest, streams, threads)
        rate = figures[f"streams{streams}"]
        print(f"  {streams:>3} streams {rate:8.1f} tokens/s   GEMM ceiling {ceiling:8.1f}   {rate / ceiling:.2f}")
