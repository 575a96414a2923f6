"""Serving benchmark, measured side by side in one run: `python -m service.bench`.

Prints single-stream decode tokens/s through gRPC versus an in-process ONNX Runtime loop and
onnxruntime-genai on the same ONNX files; aggregate tokens/s at several concurrencies; decode
step time versus context length per scheme; the share of step time spent handling the KV
cache; and KV bytes per token. Figures, not verdicts: ratios are computed within the run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
from prometheus_client import CollectorRegistry

from export.manifest import Manifest
from export.runtime import OnnxCausalLM
from models.tokenizer import TOKENIZER
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.engine.engine import Engine, EngineConfig
from service.engine.request import Request, SamplingParams
from service.engine.runner import ModelRunner, PrefilledPrompt, default_threads
from service.metrics import ServiceMetrics
from service.process import ServerProcess
from service.server import REPOSITORY_ROOT

CONTEXTS = (128, 256, 512, 1024, 2048)
REQUESTS_PER_STREAM = 4  # aggregate throughput: unary requests each stream sends back to back


def median_of(measure: Callable[[], float], runs: int = 3) -> float:
    """Median of `runs` measurements that produced a figure (NaN: the run could not be measured)."""
    figures = [figure for figure in (measure() for _ in range(runs)) if not math.isnan(figure)]
    return statistics.median(figures) if figures else math.nan


def token_arrivals(texts: Iterable[str], each: Callable[[int], None] = lambda chunks: None) -> list[tuple[float, int]]:
    """(arrival time, tokens received so far) per chunk of streamed text; `each(chunks so far)`
    runs after every chunk. A chunk may merge several steps when the reader falls behind; the
    tokenizer is byte-level, so a chunk's bytes are its tokens."""
    arrivals, count = [], 0
    for text in texts:
        count += len(text.encode())
        arrivals.append((time.perf_counter(), count))
        each(len(arrivals))
    return arrivals


def decode_rate(arrivals: list[tuple[float, int]]) -> float:
    """Tokens/s from the first chunk to the last: decode steps only (the first token is the prefill's).
    NaN when the reader got everything in one chunk (it was descheduled for the whole run)."""
    (first, first_count), (last, last_count) = arrivals[0], arrivals[-1]
    return (last_count - first_count) / (last - first) if last > first else math.nan


def stream_texts(stream: Iterator[pb.GenerateStreamResponse]) -> Iterator[str]:
    return (chunk.text for chunk in stream)


def decode_tokens_per_second_grpc(server: ServerProcess, model: str, new_tokens: int) -> float:
    request = pb.GenerateRequest(model=model, prompt="def main():\n", max_new_tokens=new_tokens)
    return decode_rate(token_arrivals(stream_texts(server.stub.GenerateStream(request, timeout=600))))


class _BareStreamer(generation_pb2_grpc.GenerationServicer):
    """A GenerateStream that yields `max_new_tokens` one-byte messages and does nothing else."""

    def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        for _ in range(request.max_new_tokens):
            yield pb.GenerateStreamResponse(text="a")


def grpc_stream_ceiling(messages: int = 5000) -> tuple[float, float]:
    """(messages/s, CPU microseconds per message) of a bare gRPC server stream read by a client in
    this process: what one chunk per token costs in transport alone, with no engine at all."""
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    generation_pb2_grpc.add_GenerationServicer_to_server(_BareStreamer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = pb.GenerateRequest(max_new_tokens=messages)
            list(stub.GenerateStream(request))  # warm-up

            def once() -> tuple[float, float]:
                wall, cpu = time.perf_counter(), time.process_time()
                count = sum(1 for _ in stub.GenerateStream(request))
                return count / (time.perf_counter() - wall), (time.process_time() - cpu) / count * 1e6

            rate, cpu = zip(*(once() for _ in range(3)), strict=True)
            return statistics.median(rate), statistics.median(cpu)
    finally:
        server.stop(0)


def decode_tokens_per_second_runner(folder: Path, new_tokens: int, threads: int) -> float:
    """The engine's own runner without gRPC, scheduler or sampler: the in-process ceiling."""
    runner = ModelRunner(Manifest.load(folder), "cpu", threads)
    prompt = runner.prefill_batch({"r": TOKENIZER.encode("def main():\n")})
    runner.join(prompt)
    token = np.array([prompt[0].logits.argmax()])
    started = time.perf_counter()
    for _ in range(new_tokens):
        token = runner.decode(token).argmax(axis=1)
    return new_tokens / (time.perf_counter() - started)


def output_texts(request: Request) -> Iterator[str]:
    """A request's streamed text read from its output stream, as the gRPC servicer reads it."""
    while True:
        event = request.output.get(timeout=10)
        if event is not None:
            yield event.text
            if event.status.finished:
                return


def decode_tokens_per_second_engine(repository: Path, model: str, new_tokens: int, threads: int) -> float:
    """The whole engine (scheduler, runner, sampler, detokenizer, output stream, metrics) in this
    process, read by a consumer thread as the gRPC servicer reads it: the service minus gRPC."""
    config = EngineConfig(max_new_tokens_limit=max(4096, new_tokens), threads=threads)
    engine = Engine.from_repository(repository, config, ServiceMetrics(CollectorRegistry()), [model])

    def once(tokens: int) -> float:
        request = engine.submit(model, "def main():\n", SamplingParams(max_new_tokens=tokens))
        return decode_rate(token_arrivals(output_texts(request)))

    engine.start()
    try:
        once(16)  # warm-up
        return median_of(lambda: once(new_tokens))
    finally:
        engine.stop(1)


def decode_tokens_per_second_plain_loop(folder: Path, new_tokens: int, threads: int) -> float:
    """A plain session.run loop on model.onnx (Optimum layout), as a user would write it."""
    runtime = OnnxCausalLM(folder, threads=threads)
    ids = TOKENIZER.encode("def main():\n")
    started = time.perf_counter()
    runtime.greedy([ids], new_tokens)
    return new_tokens / (time.perf_counter() - started)


def decode_tokens_per_second_genai(folder: Path, new_tokens: int) -> float | None:
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    model = og.Model(str(folder))
    prompt = TOKENIZER.encode("def main():\n")
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    generator.generate_next_token()  # the prefill step
    started, count = time.perf_counter(), 0
    while not generator.is_done():
        generator.generate_next_token()
        count += 1
    return count / (time.perf_counter() - started) if count else None


def aggregate_tokens_per_second(
    server: ServerProcess, model: str, streams: int, new_tokens: int, requests_per_stream: int = REQUESTS_PER_STREAM
) -> float:
    """Generated tokens/s of `streams` clients, each sending unary requests back to back, so
    every concurrency (one stream too) is measured over several requests, prefills included."""

    def client(stream: int) -> int:
        tokens = 0
        for i in range(requests_per_stream):
            prompt = f"def function_{stream}_{i}(x):\n    return x * {i}\n\n"
            request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=new_tokens, temperature=0.8, seed=i)
            tokens += server.stub.Generate(request, timeout=600).usage.completion_tokens
        return tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        total = sum(pool.map(client, range(streams)))
    return total / (time.perf_counter() - started)


def prefill_interference(server: ServerProcess, model: str, long_prompt_bytes: int = 4000) -> dict[str, float]:
    """Mean inter-token latency of a running stream while a long prompt is prefilled, against
    the same stream's tokens (same positions, same context) when it runs alone."""
    running = pb.GenerateRequest(model=model, prompt="def main():\n", max_new_tokens=3000)
    alone = token_arrivals(stream_texts(server.stub.GenerateStream(running, timeout=600)))
    window: dict[str, float] = {}

    def long_request() -> None:
        prompt = ("x = [i * 2 for i in range(10)]\n" * (long_prompt_bytes // 31 + 1))[:long_prompt_bytes]
        window["start"] = time.perf_counter()
        stream = server.stub.GenerateStream(
            pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=1), timeout=600
        )
        next(stream)
        window["end"] = time.perf_counter()
        list(stream)

    thread = threading.Thread(target=long_request)
    arrivals = token_arrivals(
        stream_texts(server.stub.GenerateStream(running, timeout=600)),
        each=lambda chunks: thread.start() if chunks == 50 else None,
    )
    thread.join()
    inside = [(t, n) for t, n in arrivals if window["start"] <= t <= window["end"]]
    before = [(t, n) for t, n in arrivals if t < window["start"]]
    if not inside or not before:
        return {
            "unloaded_ms": float("nan"),
            "during_mean_ms": float("nan"),
            "during_max_ms": float("nan"),
            "ratio_mean": float("nan"),
            "prefill_ms": (window["end"] - window["start"]) * 1000,
            "tokens": 0,
        }
    (t0, n0), (t1, n1) = before[-1], inside[-1]
    during = (t1 - t0) / (n1 - n0)

    def time_at(series: list[tuple[float, int]], n: int) -> float:
        return next(t for t, count in series if count >= n)

    unloaded = (time_at(alone, n1) - time_at(alone, n0)) / (n1 - n0)
    stalls = [b[0] - a[0] for a, b in itertools.pairwise([before[-1], *inside])]
    return {
        "unloaded_ms": unloaded * 1000,
        "during_mean_ms": during * 1000,
        "during_max_ms": max(stalls) * 1000,
        "ratio_mean": during / unloaded,
        "prefill_ms": (window["end"] - window["start"]) * 1000,
        "tokens": n1 - n0,
    }


def print_interference(label: str, figures: dict[str, float]) -> None:
    print(
        f"\nInter-token latency of a running stream while a 4000-byte prompt is prefilled, {label}, "
        f"over the same {figures['tokens']} tokens: unloaded {figures['unloaded_ms']:.3f} ms, "
        f"during prefill mean {figures['during_mean_ms']:.3f} ms (longest gap {figures['during_max_ms']:.2f} ms), "
        f"ratio {figures['ratio_mean']:.2f} (goal <= 1.5); the prefill took {figures['prefill_ms']:.0f} ms"
    )


def batch_runner(folder: Path, batch: int, context: int, threads: int, in_place: bool) -> ModelRunner:
    """A runner whose batch holds `batch` sequences of `context` tokens of random K/V."""
    runner = ModelRunner(Manifest.load(folder), "cpu", threads, in_place=in_place)
    manifest = runner.manifest
    rng = np.random.default_rng(0)
    cache = [
        rng.standard_normal((batch, manifest.n_heads, context, manifest.head_dim)).astype(np.float32) * 0.1
        for _ in runner.past_names
    ]
    logits = np.zeros(manifest.vocab_size, dtype=np.float32)
    runner.join([PrefilledPrompt(f"r{i}", logits, [layer[i : i + 1] for layer in cache]) for i in range(batch)])
    return runner


def step_seconds(runner: ModelRunner, steps: int) -> float:
    """Median decode step time at the batch's context: each step's new column is taken back
    (in place), so every step reads the same context."""
    tokens = np.full(len(runner.rows), 65)
    batch = len(runner.rows)

    def take_back() -> None:
        if runner.in_place:
            runner.filled -= 1
            runner.mask[:batch, runner.filled] = 0
            runner.positions[:batch] -= 1

    runner.decode(tokens)  # warm-up
    take_back()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        runner.decode(tokens)
        times.append(time.perf_counter() - started)
        take_back()
    return statistics.median(times)


def cache_share(folder: Path, batch: int, context: int, threads: int, in_place: bool, steps: int) -> dict[str, float]:
    """Share of decode step time spent on the cache: host copies plus in-graph KV Concat kernels.

    Step time and host copies come from an unprofiled run; the Concat share of kernel time
    from a profiled one (profiling slows every kernel alike), scaled to the graph's share.
    """
    runner = batch_runner(folder, batch, context, threads, in_place)
    step = step_seconds(runner, steps)
    runner.timings.graph = runner.timings.cache = 0.0
    for _ in range(steps):
        runner.decode(np.full(len(runner.rows), 65))
    host, graph = runner.timings.cache / steps, runner.timings.graph / steps

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.intra_op_num_threads = threads
    options.profile_file_prefix = str(Path(tempfile.gettempdir()) / "posenc-profile")
    runner.session = ort.InferenceSession(
        str(runner.manifest.onnx_path(runner.variant)), options, providers=["CPUExecutionProvider"]
    )
    runner._binding = None  # bind the new session
    for _ in range(steps):
        runner.decode(np.full(len(runner.rows), 65))
    profile_path = Path(runner.session.end_profiling())
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repository", type=Path, default=REPOSITORY_ROOT / "model_repository")
    parser.add_argument("--model", default="alibi", help="model for the single-stream and concurrency figures")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per session (0: half the cores)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--quick", action="store_true", help="fewer steps and contexts")
    args = parser.parse_args(argv)
    repository: Path = args.model_repository
    server_threads = args.threads  # 0: the server's own default (decode half the cores, prefill all)
    args.threads = args.threads or default_threads()  # decode threads, for the in-process figures
    folders = sorted(p for p in repository.iterdir() if (p / "manifest.json").is_file())
    steps = 5 if args.quick else 20

    print("KV bytes per token (float32, K and V of every layer):")
    for folder in folders:
        manifest = Manifest.load(folder)
        limit = manifest.max_positions or "unbounded"
        print(f"  {manifest.name:<12} {manifest.kv_bytes_per_token():>6} B/token   positions: {limit}")

    folder = repository / args.model
    print(f"\nSingle-stream decode, {args.new_tokens} tokens, model {args.model}, {args.threads} decode threads:")
    server = ServerProcess(repository, "--models", args.model, "--max-new-tokens-limit", "4096", threads=server_threads)
    try:
        server.wait_serving()
        decode_tokens_per_second_grpc(server, args.model, 16)  # warm-up
        # Median of three runs each: the machine is noisy and one run can land on a busy moment.
        figures = {
            "gRPC service": median_of(lambda: decode_tokens_per_second_grpc(server, args.model, args.new_tokens)),
            "in-process engine (no gRPC)": decode_tokens_per_second_engine(
                repository, args.model, args.new_tokens, server_threads
            ),
            "in-process runner": median_of(
                lambda: decode_tokens_per_second_runner(folder, args.new_tokens, args.threads)
            ),
            "in-process session.run loop": median_of(
                lambda: decode_tokens_per_second_plain_loop(folder, args.new_tokens, args.threads)
            ),
        }
        genai = decode_tokens_per_second_genai(folder, args.new_tokens)
        if genai is not None:
            genai = median_of(lambda: decode_tokens_per_second_genai(folder, args.new_tokens) or math.nan)
            figures["onnxruntime-genai"] = genai
        for name, value in figures.items():
            print(f"  {name:<30} {value:8.1f} tokens/s")
        grpc_rate = figures["gRPC service"]
        print(f"  gRPC / in-process runner        {grpc_rate / figures['in-process runner']:.2f}  (goal >= 0.9)")
        print(f"  gRPC / in-process session.run   {grpc_rate / figures['in-process session.run loop']:.2f}")
        print(f"  gRPC / in-process engine        {grpc_rate / figures['in-process engine (no gRPC)']:.2f}")
        if genai is not None:
            print(f"  gRPC / onnxruntime-genai        {grpc_rate / genai:.2f}  (goal >= 0.8)")
        ceiling, cpu_per_message = grpc_stream_ceiling()
        print(
            f"  gRPC transport alone (a bare server stream of one-byte messages, no engine): {ceiling:.0f} "
            f"messages/s, {cpu_per_message:.0f} us of CPU per message (server and client together); one "
            f"chunk per token at {grpc_rate:.0f} tokens/s takes {grpc_rate * cpu_per_message / 1e4:.0f}% "
            "of one core for transport alone"
        )

        interference = prefill_interference(server, args.model)
        print_interference("prefill worker at nice +10 (default)", interference)
        print(
            f"\nAggregate throughput through gRPC (each stream: {REQUESTS_PER_STREAM} unary requests of "
            f"{args.new_tokens // 2} new tokens back to back, prefills included):"
        )
        rates = {}
        for streams in args.concurrency:
            rates[streams] = aggregate_tokens_per_second(server, args.model, streams, args.new_tokens // 2)
            print(
                f"  {streams:>3} streams  {rates[streams]:8.1f} tokens/s   "
                f"{rates[streams] / rates[args.concurrency[0]]:5.2f}x"
            )
    finally:
        server.stop()
    one_runner, sixteen_runner = (batch_runner(folder, batch, 128, args.threads, True) for batch in (1, 16))
    pairs = [(step_seconds(one_runner, steps * 5), step_seconds(sixteen_runner, steps * 5)) for _ in range(3)]
    one, sixteen = (statistics.median(times) for times in zip(*pairs, strict=True))
    print(
        f"  graph alone (runner, context 128): step {one * 1000:.3f} ms at batch 1, {sixteen * 1000:.3f} ms at "
        f"batch 16, so 16 streams can be at most {16 * one / sixteen:.2f}x one stream here"
    )
    server = ServerProcess(repository, "--models", args.model, "--max-new-tokens-limit", "4096", "--prefill-nice", "0",
                           threads=server_threads)  # fmt: skip
    try:
        print_interference(
            "prefill worker at the same priority", prefill_interference(server.wait_serving(), args.model)
        )
    finally:
        server.stop()
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
            one = step_seconds(batch_runner(folder, 1, context, args.threads, True), steps) * 1000
            eight = step_seconds(batch_runner(folder, 8, context, args.threads, True), steps) * 1000
            cells.append(f"{one:7.2f} /{eight:7.2f}")
        print(f"  {manifest.name:<12}" + "".join(cells))

    print("\nCache handling share of decode step time, batch 8, context 2048 (goal <= 20%):")
    share_folder = repository / args.model
    for in_place, label in ((False, "present->past graph (Concat)"), (True, "in-place serving graph")):
        share = cache_share(share_folder, 8, 2048, args.threads, in_place, steps)
        print(
            f"  {label:<30} step {share['step_ms']:7.2f} ms   host copies {share['host_cache_ms']:6.2f} ms   "
            f"KV Concat {share['kv_concat_ms']:6.2f} ms   share {share['share'] * 100:5.1f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
