"""`python -m bench --size small`: every scheme at a realistic width, held against the physical limit.

A decode step at GPT-2 small's width reads every weight and the cached K/V it attends to once, so
one stream cannot decode faster than memory bandwidth over those bytes (the roofline), nor, where its
attention's arithmetic outgrows its reads (latent attention at long context), than its FLOPs at the
one-thread MatMul rate of its shapes (the compute roof, printed at 4,096 tokens beside the other). This run
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
import gc
import math
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from threadpoolctl import threadpool_limits

from bench.layers import decode_tokens_per_second_genai, decode_tokens_per_second_grpc_counted
from bench.long_context import BASELINE, LONG_CONTEXTS
from bench.prefill import (
    attended_tokens,
    decode_attention_products,
    decode_flops,
    gemm_gflops,
    grpc_ttft,
    linear_shapes,
    prefill_flops,
    prompt_text,
)
from bench.runners import batch_runner, step_seconds
from contract.manifest import Manifest, serving_variant
from export.fused import IR_VERSION
from models.sizes import RANDOM_SCHEMES
from service.api import generation_pb2 as pb
from service.engine.messages import EngineConfig
from service.engine.worker.model_session import serving_plan
from service.engine.worker.runner import ModelRunner
from service.process import ServerProcess

BANDWIDTH_BUFFER = 1 << 28  # 256 MiB: eight times this machine's 32 MiB last-level cache
READ_ROW = 4096  # the matrix-vector read's row (floats): 16 KB rows read fastest here (sgemv probe)
BUDGET = 1 << 30  # the cache memory the capacity column fills: 1 GiB
LONG = LONG_CONTEXTS[-1]  # the context of the decode@4096 and ITL@4096 lines
PROMPT_BYTES = 2048
STREAMS = (16, 64)
# The schemes measured, the baseline first.
SCHEMES = RANDOM_SCHEMES
# A MatMul's operands: the left's shape, the right's name (products naming one share it), its shape as
# stored, and whether the node transposes its last two axes.
Product = tuple[tuple[int, ...], str, tuple[int, ...], bool]


class Bandwidth:
    """Reads of a BANDWIDTH_BUFFER-byte buffer split over `threads` threads: the rate decode's weight and
    K/V reads cannot beat. Two kernels read it, and the faster sets the rate: numpy's sum (as float64;
    on some builds its pairwise adds, not the memory, bound it: 15 GB/s against 23 on one Zen 3 core)
    and a one-thread BLAS matrix-vector product over it as float32 (two FLOPs a 4-byte load, the
    reference for a one-row product; both release the GIL). On a shared machine the rate moves from
    minute to minute, so each figure is held against a read taken right beside it."""

    def __init__(self, threads: int, size: int = BANDWIDTH_BUFFER) -> None:
        rows = np.ones((size // 4 // READ_ROW, READ_ROW), dtype=np.float32)
        self.size, self.parts = rows.nbytes, np.array_split(rows, threads)  # whole rows, any thread count
        self.vector = np.ones(READ_ROW, dtype=np.float32)
        self.pool = ThreadPoolExecutor(threads)
        self.readings: list[float] = []
        self()  # touch every page first

    def _sum(self, part: np.ndarray) -> float:
        return float(part.reshape(-1).view(np.float64).sum())

    def _matvec(self, part: np.ndarray) -> float:
        return float((part @ self.vector)[0])

    def _read(self, kernel: Callable[[np.ndarray], float]) -> float:
        return _seconds(lambda: list(self.pool.map(kernel, self.parts)))

    def __call__(self, runs: int = 3) -> float:
        """Bytes/s, the best of `runs` reads by each kernel; every reading is kept for the header's median."""
        with threadpool_limits(1, user_api="blas"):  # one BLAS thread a part: `threads` in all
            best = min(self._read(kernel) for kernel in (self._sum, self._matvec) for _ in range(runs))
        self.readings.append(self.size / best)
        return self.size / best


def weight_bytes(manifest: Manifest) -> int:
    """Bytes of weights a decode step reads: the served decode graph's file (the fused one, or the
    serving graph where there is none: latent attention's), which is its weights (and a weight-only
    model's scales, export/weight_only.py) and a few KB of graph; the embedding's one row a step is
    the exception, 0.2% of the model at 259 x 768."""
    plan = serving_plan(manifest, "cpu", "auto", EngineConfig().block_size)
    return manifest.onnx_path(plan.fused.variant if plan.fused else serving_variant(plan.dtype)).stat().st_size


def kv_read_bytes(manifest: Manifest, context: int) -> int:
    """K/V bytes a step reads at `context` tokens, as the server lays the row out: every layer's K and
    V a token, or a split hybrid's global layers' a token plus its local layers' window."""
    layout = serving_plan(manifest, "cpu", "auto", EngineConfig().block_size).layout
    return layout.token_bytes * context + layout.local_row_bytes


def roofline(bandwidth: float, manifest: Manifest, context: int, flops_rate: float = math.inf) -> float:
    """Tokens/s one stream can reach at `context`: one over the step's floor (step_floor) of the bytes
    it reads at `bandwidth` and its FLOPs (bench.prefill.decode_flops) at `flops_rate` a second; the
    default, no rate, is the bandwidth roof alone."""
    return 1 / step_floor(manifest, context, bandwidth, flops_rate)[0]


def step_floor(manifest: Manifest, context: int, bandwidth: float, flops_rate: float) -> tuple[float, str]:
    """(seconds, the roof that sets them) of a decode step at `context`: its bytes over the bandwidth
    or its FLOPs over the rate, whichever takes longer (the two roofs of a roofline)."""
    return binding_roof(weight_bytes(manifest) + kv_read_bytes(manifest, context), bandwidth,
                        decode_flops(manifest, context), flops_rate)  # fmt: skip


def binding_roof(bytes_read: float, bandwidth: float, flops: float, flops_rate: float) -> tuple[float, str]:
    """(seconds, "bandwidth" or "compute"): the larger of bytes_read / bandwidth and flops / flops_rate."""
    memory, compute = bytes_read / bandwidth, flops / flops_rate
    return (compute, "compute") if compute > memory else (memory, "bandwidth")


def gemm_ceiling(manifest: Manifest, rows: int, threads: int, runs: int = 5) -> float:
    """Tokens/s of a decode step's matrix products alone at `rows` streams, by ONNX Runtime's own
    MatMul kernels on `threads` threads with the model's weight shapes (random, so they stream from
    memory as the model's do): what aggregate decode at that batch cannot beat."""
    products = [((m, k), f"w{i}", (k, n), False) for i, (m, k, n) in enumerate(linear_shapes(manifest, rows))]
    return rows / matmul_seconds(products, threads, runs, weights=True)


def attention_flops_rate(manifest: Manifest, context: int, threads: int, runs: int = 5) -> float:
    """FLOPs/s of ONNX Runtime's MatMul on `threads` threads at a global layer's attention products of
    a decode step at `context` (bench.prefill.decode_attention_products), each right-hand operand laid
    out as a cache lies, tokens by width (the scores' transposed by the graph, as the latent serving
    graph does), fed as an input as the cache is: the rate of the step's arithmetic at its shapes,
    its operands held in cache between runs, so a rate of arithmetic, not of memory (latent attention's
    12 query rows a product; full attention's one row a head makes matrix-vector products, whose rate
    is nearer a cached read's). Latent attention's one cached entry is both products' right-hand
    operand, as in its graph; full attention's K and V are two. The step's linear layers' FLOPs are
    held to the same rate (step_floor): their one-row products are their bytes' anyway."""
    shapes = decode_attention_products(manifest, max(attended_tokens(manifest, context)))
    (batch, rows, width, tokens), _ = shapes
    keys, values = manifest.kv_spec.entries[0], manifest.kv_spec.entries[-1]
    cache = (batch, tokens, width)
    products = [((batch, rows, width), keys, cache, True), ((batch, rows, tokens), values, cache, False)]
    flops = sum(2 * b * m * k * n for b, m, k, n in shapes)
    return flops / matmul_seconds(products, threads, runs, weights=False)


def matmul_seconds(products: list[Product], threads: int, runs: int, weights: bool) -> float:
    """Best seconds of `runs` runs of one ONNX Runtime graph of a MatMul node per product (Product), on
    `threads` threads; each right-hand operand a random array of its own name, an initializer
    (`weights`) or an input."""
    rng = np.random.default_rng(0)
    nodes, outputs = [], []
    feeds: dict[str, np.ndarray] = {}
    rights: dict[str, np.ndarray] = {}
    for i, (left, operand, right, transposed) in enumerate(products):
        feeds[f"x{i}"] = rng.standard_normal(left).astype(np.float32)
        if operand not in rights:
            rights[operand] = rng.standard_normal(right).astype(np.float32)
        if transposed:
            axes = list(range(len(right)))
            nodes.append(helper.make_node("Transpose", [operand], [f"t{i}"], perm=axes[:-2] + axes[:-3:-1]))
            operand = f"t{i}"
        nodes.append(helper.make_node("MatMul", [f"x{i}", operand], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    initializers = [numpy_helper.from_array(matrix, name) for name, matrix in rights.items()] if weights else []
    feeds |= {} if weights else rights
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, list(a.shape)) for name, a in feeds.items()]
    graph = helper.make_graph(nodes, "matmuls", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)  # warm-up
    return min(_seconds(lambda: session.run(None, feeds)) for _ in range(runs))


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


def serve_figures(
    folder: Path, args: argparse.Namespace, server_threads: int, bandwidth: Bandwidth
) -> dict[str, float]:
    """Through gRPC, one server for this model alone (at 85 M parameters each served model holds
    its graphs' weights): one stream's decode with a bandwidth read beside each run (the ratio to the
    roofline: the median of the runs'), a 2 KB prompt's time to first token, and for the baseline
    onnxruntime-genai alternated with gRPC, numpy's sgemm over the prompt's shapes, and the decode
    rate of STREAMS streams, each followed by its GEMM ceiling."""
    name, manifest = folder.name, Manifest.load(folder)
    # The capacity column's budget: the default 256 MiB holds no 4,096-token row at this width.
    server = ServerProcess(folder.parent, "--models", name, "--max-new-tokens-limit", "4096", "--kv-cache-bytes",
                           str(BUDGET), "--device", args.device, threads=server_threads)  # fmt: skip
    salt = iter(range(10**9))
    new_tokens, short = new_tokens_of(args), short_context(new_tokens_of(args))
    grpc, ratios, genai, ttft = [], [], [], []
    figures: dict[str, float] = {}
    try:
        server.wait_serving(timeout=600)
        decode_tokens_per_second_grpc_counted(server, name, 8)  # warm-up
        grpc_ttft(server, name, prompt_text(300, next(salt)))
        for _ in range(rounds_of(args)):  # gRPC and genai alternated, each beside a bandwidth read
            read = bandwidth()
            grpc.append(decode_tokens_per_second_grpc_counted(server, name, new_tokens))
            ratios.append(grpc[-1] / roofline((read + bandwidth()) / 2, manifest, short))
            if name == BASELINE:
                genai.append(decode_tokens_per_second_genai(folder, new_tokens, args.threads) or math.nan)
        ttft = [grpc_ttft(server, name, prompt_text(PROMPT_BYTES, next(salt))) for _ in range(3)]
        figures |= {"grpc": statistics.median(grpc), "ratio": statistics.median(ratios)}
        figures["ttft"] = statistics.median(ttft)
        if name == BASELINE:
            figures["genai"] = statistics.median(genai)
            figures["genai_ratio"] = statistics.median(a / b for a, b in zip(grpc, genai, strict=True))
            figures["sgemm"] = gemm_gflops(linear_shapes(manifest, PROMPT_BYTES + 1), runs=2)
            for streams in STREAMS:
                figures[f"streams{streams}"] = concurrent_decode_rate(server, name, streams, 2 * new_tokens)
                figures[f"ceiling{streams}"] = gemm_ceiling(manifest, streams, args.threads)
    finally:
        server.stop()
    return figures


def concurrent_decode_rate(server: ServerProcess, model: str, streams: int, new_tokens: int) -> float:
    """Tokens/s of `streams` greedy streams started together, while most of them decode: the chunks
    that arrive between the median stream's first chunk and the median stream's last, over that
    window (most prompts are prefilled before it and most streams still run at its end; at this width
    a step outlasts the server's 4 ms pacing, so a chunk is a step's token)."""

    def client(stream: int) -> list[float]:
        prompt = f"def function_{stream}(x):\n"
        request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=new_tokens, ignore_eos=True)
        return [time.perf_counter() for _ in server.stub.GenerateStream(request, timeout=600)]

    with ThreadPoolExecutor(max_workers=streams) as pool:
        arrivals = list(pool.map(client, range(streams)))
    start = statistics.median(times[0] for times in arrivals)
    end = statistics.median(times[-1] for times in arrivals)
    chunks = sum(1 for times in arrivals for t in times if start < t <= end)
    return chunks / (end - start) if end > start else math.nan


def new_tokens_of(args: argparse.Namespace) -> int:
    return 64 if args.quick else 128


def rounds_of(args: argparse.Namespace) -> int:
    return 3 if args.quick else 5


def context_steps(
    folder: Path, args: argparse.Namespace, bandwidth: Bandwidth, baseline: ModelRunner
) -> dict[int, dict[str, float]]:
    """Per context of LONG_CONTEXTS (batch 1, random K/V): the median decode step seconds, the median
    of each step timing's ratio to the roofline of a bandwidth read beside it, and (at LONG) the
    median ratio to the baseline's step at LONG timed right after it (`baseline`, held for the whole
    run) and the roofline with both roofs: the MatMul rate at the step's attention shapes is measured
    right after the reads (attention_flops_rate), and each round's ratio is to its own floor
    (step_floor). One model's runners at a time: at this width every model's do not fit side by side."""
    steps, manifest = 5 if args.quick else 20, Manifest.load(folder)
    runners = {
        context: batch_runner(folder, 1, context, args.threads, args.device, prompts=False) for context in LONG_CONTEXTS
    }
    samples: dict[int, list[tuple[float, float]]] = {context: [] for context in LONG_CONTEXTS}
    against: list[float] = []
    roofs: list[tuple[float, bool, float, float]] = []  # (ratio, compute binds, bandwidth, FLOPs/s) at LONG
    for _ in range(rounds_of(args)):
        for context, runner in runners.items():
            read = bandwidth()
            seconds = step_seconds(runner, steps)
            read = (read + bandwidth()) / 2
            samples[context].append((seconds, 1 / seconds / roofline(read, manifest, context)))
            if context == LONG:
                rate = attention_flops_rate(manifest, LONG, args.threads)
                floor, roof = step_floor(manifest, LONG, read, rate)
                roofs.append((floor / seconds, roof == "compute", read, rate))
        against.append(samples[LONG][-1][0] / step_seconds(baseline, steps))
    figures = {
        context: {"seconds": statistics.median(t for t, _ in rows), "ratio": statistics.median(r for _, r in rows)}
        for context, rows in samples.items()
    }
    figures[LONG]["vs_baseline"] = statistics.median(against)
    ratios, computes, reads, rates = zip(*roofs, strict=True)
    figures[LONG] |= {
        "roof_ratio": statistics.median(ratios), "compute_rounds": sum(computes), "rounds": len(roofs),
        "bandwidth": statistics.median(reads), "flops_rate": statistics.median(rates),
    }  # fmt: skip
    return figures


def roof_line(name: str, manifest: Manifest, figures: dict[str, float], threads: int) -> str:
    """A scheme's step at LONG against the roofline with both roofs: the median of the rounds' ratios,
    the roof that bound most rounds, and both floors at the rounds' median bandwidth and FLOP rate."""
    compute = figures["compute_rounds"] > figures["rounds"] / 2
    step_bytes, flops = weight_bytes(manifest) + kv_read_bytes(manifest, LONG), decode_flops(manifest, LONG)
    return (
        f"{name} decode@{LONG}/two-roof roofline {figures['roof_ratio']:.2f}, {'compute' if compute else 'bandwidth'} "
        f"binds ({int(figures['compute_rounds'])} of {int(figures['rounds'])} rounds compute; {flops / 1e9:.2f} GFLOP "
        f"at {figures['flops_rate'] / 1e9:.1f} GFLOP/s on {threads} thread(s): "
        f"{flops / figures['flops_rate'] * 1000:.1f} ms; {step_bytes / 1e6:.0f} MB at "
        f"{figures['bandwidth'] / 1e9:.1f} GB/s: {step_bytes / figures['bandwidth'] * 1000:.1f} ms)"
    )


def print_width(args: argparse.Namespace, repository: Path, server_threads: int) -> None:
    """The whole `--size` run: header, per-scheme table, aggregate and prefill, then the ratio lines."""
    folders = small_folders(repository, (BASELINE, *(s for s in args.schemes if s != BASELINE)))
    bandwidth = Bandwidth(args.threads)
    print_header(folders, bandwidth(5), args.threads)
    serving = {f.name: serve_figures(f, args, server_threads, bandwidth) for f in folders}
    baseline = batch_runner(folders[0], 1, LONG, args.threads, args.device, prompts=False)
    itl = {}
    for folder in folders:
        itl[folder.name] = context_steps(folder, args, bandwidth, baseline)
        gc.collect()  # a runner's sessions sit in reference cycles: free one model's before the next's
    del baseline
    manifests = {f.name: Manifest.load(f) for f in folders}
    print_table(manifests, serving, itl, args, statistics.median(bandwidth.readings))
    base, figures = manifests[BASELINE], serving[BASELINE]
    print_aggregate(figures, args.threads)
    print(f"\n{PROMPT_BYTES}-byte prompt through gRPC ({os.cpu_count()} prefill threads; median of 3): time to first "
          f"token, and the prompt's FLOPs / TTFT against numpy's sgemm over the same linear layers at "
          f"{PROMPT_BYTES + 1} rows ({figures['sgemm']:.1f} GFLOP/s in this run, its own threads):")  # fmt: skip
    for name, manifest in manifests.items():
        rate = prefill_flops(manifest, PROMPT_BYTES + 1) / serving[name]["ttft"] / 1e9
        print(f"  {name:<12}{serving[name]['ttft'] * 1000:10.0f} ms {rate:8.1f} GFLOP/s")
    print(f"\nmemory bandwidth: median {statistics.median(bandwidth.readings) / 1e9:.1f} GB/s of "
          f"{len(bandwidth.readings)} reads over the run ({min(bandwidth.readings) / 1e9:.1f}-"
          f"{max(bandwidth.readings) / 1e9:.1f}); each ratio below is the median of its runs' ratios, every "
          "run against the reads beside it (a hybrid over rope: rope's step timed right after its own)\n")  # fmt: skip
    for name in manifests:
        print(f"{name} decode/roofline {serving[name]['ratio']:.2f}")
    for name in manifests:
        print(f"{name} decode@{LONG}/roofline {itl[name][LONG]['ratio']:.2f}")
    for name, manifest in manifests.items():  # the same steps against both roofs
        print(roof_line(name, manifest, itl[name][LONG], args.threads))
    print(f"gRPC/genai {figures['genai_ratio']:.2f}")
    rate = prefill_flops(base, PROMPT_BYTES + 1) / figures["ttft"] / 1e9
    print(f"prefill/sgemm {rate / figures['sgemm']:.2f}")
    for name in manifests:  # every scheme, and weight-only forms (export/weight_only.py), over rope
        if name != BASELINE:
            print(f"{name} / {BASELINE} ITL@{LONG} {itl[name][LONG]['vs_baseline']:.2f}")
    # The schemes that cut the cache (the hybrids' windows, latent attention's latent).
    hybrids = [(name, m) for name, m in manifests.items() if kv_read_bytes(m, LONG) < kv_read_bytes(base, LONG)]
    if hybrids:
        shares = ", ".join(f"{name} {batch_step_bytes(m, 16) / batch_step_bytes(base, 16):.2f}" for name, m in hybrids)
        print(f"\n(at 16 streams of {LONG} tokens a step reads the weights once and 16 rows of K/V: by the roofline "
              f"the step of a scheme that cuts the cache is then {shares} of {BASELINE}'s)")  # fmt: skip


def batch_step_bytes(manifest: Manifest, rows: int) -> int:
    """Bytes a decode step of `rows` rows of LONG tokens reads: the weights once, every row's K/V."""
    return weight_bytes(manifest) + rows * kv_read_bytes(manifest, LONG)


def short_context(new_tokens: int) -> int:
    """The mean context of the one-stream runs: the prompt ("def main():\\n" and BOS) and half the tokens."""
    return 13 + new_tokens // 2


def print_table(
    manifests: dict[str, Manifest],
    serving: dict[str, dict[str, float]],
    itl: dict[str, dict[int, dict[str, float]]],
    args: argparse.Namespace,
    bandwidth: float,
) -> None:
    """One row per scheme: gRPC decode, inter-token latency per context, and the rooflines at the run's
    median bandwidth (the ratios take each run's own reads)."""
    new_tokens = new_tokens_of(args)
    print(
        f"\nOne stream through gRPC ({new_tokens} tokens, {args.threads} decode thread(s), median of "
        f"{rounds_of(args)}) and inter-token latency (runner, batch 1, median of {rounds_of(args)} rounds of "
        f"{5 if args.quick else 20} steps), rooflines at {bandwidth / 1e9:.1f} GB/s (weights + K/V a step reads):"
    )
    header = "".join(f"{f'ITL@{c} ms':>14}" for c in LONG_CONTEXTS) + "".join(
        f"{f'roof@{c}':>12}" for c in LONG_CONTEXTS
    )
    print("  " + f"{'model':<12}{'tokens/s':>10}{'roofline':>10}" + header)
    for name, manifest in manifests.items():
        cells = "".join(f"{itl[name][c]['seconds'] * 1000:14.1f}" for c in LONG_CONTEXTS)
        roofs = "".join(f"{1000 / roofline(bandwidth, manifest, c):12.1f}" for c in LONG_CONTEXTS)
        limit = roofline(bandwidth, manifest, short_context(new_tokens))
        print(f"  {name:<12}{serving[name]['grpc']:10.1f}{limit:10.1f}{cells}{roofs}")


def print_aggregate(figures: dict[str, float], threads: int) -> None:
    """Aggregate tokens/s at each of STREAMS against ONNX Runtime's matrix products at that batch
    (gemm_ceiling, measured right after it)."""
    print(f"\nAggregate decode through gRPC ({BASELINE}; greedy streams, tokens a second while all of them "
          f"decode) against the step's matrix products alone at that batch (ONNX Runtime MatMul, {threads} "
          "thread(s)):")  # fmt: skip
    for streams in STREAMS:
        rate, ceiling = figures[f"streams{streams}"], figures[f"ceiling{streams}"]
        print(f"  {streams:>3} streams {rate:8.1f} tokens/s   GEMM ceiling {ceiling:8.1f}   {rate / ceiling:.2f}")
