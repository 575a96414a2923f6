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
import logging
import math
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
from prometheus_client import CollectorRegistry

from contract.cache_policy import FULL_POLICY, CachePolicy, parse_cache_policy
from contract.cli import HelpFormatter
from contract.manifest import NP_DTYPES, Manifest
from contract.paths import REPOSITORY_ROOT
from export.runtime import OnnxCausalLM
from models.tokenizer import TOKENIZER
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.engine.engine import Engine
from service.engine.messages import EngineConfig, GenerateInput
from service.engine.request import Request
from service.engine.runner import ModelRunner, PrefilledPrompt, StoreConfig, default_threads
from service.engine_client import EngineClient, RequestHandle
from service.metrics import ServiceMetrics
from service.process import ServerProcess

CONTEXTS = (128, 256, 512, 1024, 2048)
SECTIONS = ("mixed", "throughput", "steps", "share", "policies", "fused")
POLICY_HISTORY = 2048  # tokens a sequence has seen when its step time per cache policy is measured
BENCH_POLICIES = ("full", "window:256", "sinks:4+window:252", "window:64", "int8", "window:256+int8")
logger = logging.getLogger(__name__)
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


def decode_tokens_per_second_runner(folder: Path, new_tokens: int, threads: int, device: str = "cpu") -> float:
    """The engine's own runner without gRPC, scheduler or sampler: the in-process ceiling. It
    decodes as the engine's steady batch does, one plan until the row fills and moves up."""
    runner = ModelRunner(Manifest.load(folder), StoreConfig(1 << 34, 16, 4096), device, threads)
    prompt = runner.prefill_batch({"r": TOKENIZER.encode("def main():\n")})[0]
    runner.store.reserve("r", prompt.length + 1)
    runner.join([prompt])
    token = int(prompt.logits.argmax())
    plan = runner.plan_decode(["r"])
    started = time.perf_counter()
    for step in range(new_tokens):
        if runner.store.capacity("r") < prompt.length + step + 1:  # the row is full: a wider one
            runner.store.reserve("r", prompt.length + step + 1)
            plan = runner.plan_decode(["r"])
        token = int(runner.decode_planned(plan, [token])[0].argmax())
    return new_tokens / (time.perf_counter() - started)


def output_texts(request: Request | RequestHandle) -> Iterator[str]:
    """A request's streamed text read from its output stream, as the gRPC servicer reads it."""
    while True:
        event = request.output.get(timeout=10)
        if event is not None:
            yield event.text
            if event.status.finished:
                return


def decode_tokens_per_second_engine(repository: Path, model: str, new_tokens: int, threads: int) -> float:
    """The whole engine (scheduler, runner, sampler, detokenizer, output stream, metrics) in this
    process, read by a consumer thread as the gRPC servicer read it before the engine had a process
    of its own: the one-process service minus gRPC."""
    config = EngineConfig(max_new_tokens_limit=max(4096, new_tokens), threads=threads)
    engine = Engine.from_repository(repository, config, ServiceMetrics(CollectorRegistry()), [model])
    return stream_rate(engine, model, new_tokens)


def decode_tokens_per_second_core(repository: Path, model: str, new_tokens: int, threads: int) -> float:
    """The engine core in its own process, as the server runs it, read through its client in this
    process (the text arrives as the core's per-step messages): the service minus gRPC."""
    config = EngineConfig(max_new_tokens_limit=max(4096, new_tokens), threads=threads)
    return stream_rate(EngineClient(repository, config, [model]), model, new_tokens)


def stream_rate(engine: Engine | EngineClient, model: str, new_tokens: int) -> float:
    """Median decode tokens/s of one stream read from `engine` (started here, stopped after)."""

    def once(tokens: int) -> float:
        handle = engine.submit(GenerateInput(model, "def main():\n", max_new_tokens=tokens))
        return decode_rate(token_arrivals(output_texts(handle)))

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


def decode_tokens_per_second_genai(folder: Path, new_tokens: int, threads: int) -> float | None:
    """onnxruntime-genai's own loop on the same model.onnx, with `threads` intra-op threads (as ours)."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
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


def batch_runner(
    folder: Path,
    batch: int,
    context: int,
    threads: int,
    device: str = "cpu",
    backend: str = "auto",
    attention: str = "auto",
) -> ModelRunner:
    """A runner whose store holds `batch` sequences of `context` tokens of random K/V."""
    return policy_runner(folder, batch, context, FULL_POLICY, threads, device, backend, attention)


def policy_runner(
    folder: Path,
    batch: int,
    history: int,
    policy: CachePolicy,
    threads: int,
    device: str = "cpu",
    backend: str = "auto",
    attention: str = "auto",
) -> ModelRunner:
    """A runner whose store holds `batch` sequences that have seen `history` tokens under `policy`
    (random K/V): a bounded row holds its budget and has evicted the rest."""
    store = StoreConfig(1 << 34, 16, max(4096, history + 64))
    runner = ModelRunner(Manifest.load(folder), store, device, threads, backend, attention=attention)
    layout = runner.layout
    rng = np.random.default_rng(0)
    cached = policy.cached(history)
    shape = (layout.tensors, layout.n_heads, cached, layout.head_dim)
    logits = np.zeros(runner.manifest.vocab_size, dtype=np.float32)
    prompts = []
    for i in range(batch):
        cache = runner.backend.upload((rng.standard_normal(shape) * 0.1).astype(NP_DTYPES[runner.dtype]))
        runner.store.reserve(f"r{i}", policy.cached(history + 1), policy.int8)
        row = runner.row_policy(policy)
        row.evicted = history - cached
        prompts.append(PrefilledPrompt(f"r{i}", logits, cache, cached, row))
    runner.join(prompts)
    return runner


def planned_step(runner: ModelRunner) -> Callable[[], np.ndarray]:
    """One decode step of every member of the store, as the engine's steady batch takes it (one
    plan of bound calls, each row fed a token)."""
    members = runner.store.members()
    plan = runner.plan_decode(members)
    tokens = [65] * len(members)
    return lambda: runner.decode_planned(plan, tokens)


def bounded_step_seconds(runner: ModelRunner, steps: int) -> float:
    """Median decode step time of bounded rows: every step evicts one token and appends one, so
    the history grows while the cache stays the same size."""
    step = planned_step(runner)
    step()  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def step_seconds(runner: ModelRunner, steps: int) -> float:
    """Median decode step time at the store's context: each step's new column is taken back,
    so every step reads the same context."""
    step = planned_step(runner)
    step()  # warm-up
    runner.store.rewind(1)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        runner.store.rewind(1)
    return statistics.median(times)


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


DECODE_SUM = 'posenc_step_duration_seconds_sum{phase="decode"}'
DECODE_COUNT = 'posenc_step_duration_seconds_count{phase="decode"}'
W1_GAUGES = [
    "posenc_kv_cache_used_bytes",
    "posenc_kv_cache_physical_bytes",
    "posenc_kv_cache_physical_peak_bytes",
    "posenc_kv_cache_capacity_bytes",
    "posenc_running_sequences",
    DECODE_SUM,
    DECODE_COUNT,
]


@dataclass
class MixedLengthsFigures:
    """What an outside process saw of the KV cache while one long and many short sequences ran."""

    samples: list[dict[str, float]]
    peak_physical: float  # max of the sampled physical bytes and the store's own high-water mark
    capacity: float
    texts: list[str]

    def busy(self, running: int = 8) -> list[dict[str, float]]:
        return [s for s in self.samples if s["posenc_running_sequences"] >= running]

    @property
    def used_over_physical(self) -> float:
        """Median over scrapes with 8 or more sequences running."""
        ratios = [
            s["posenc_kv_cache_used_bytes"] / s["posenc_kv_cache_physical_bytes"]
            for s in self.busy()
            if s["posenc_kv_cache_physical_bytes"] > 0  # (before the store: prompts not yet in the batch)
        ]
        return statistics.median(ratios) if ratios else math.nan

    @property
    def decode_step_seconds(self) -> float:
        """Mean decode step time between scrapes while 8 or more sequences ran."""
        busy = self.busy()
        if len(busy) < 2:
            return math.nan
        steps = busy[-1][DECODE_COUNT] - busy[0][DECODE_COUNT]
        return (busy[-1][DECODE_SUM] - busy[0][DECODE_SUM]) / steps if steps else math.nan


def mixed_lengths_workload(
    server: ServerProcess,
    model: str,
    long_prompt_bytes: int = 3000,
    short_streams: int = 15,
    short_prompt_bytes: int = 50,
    new_tokens: int = 1000,
    delay: float = 1.5,
    interval: float = 0.05,
) -> MixedLengthsFigures:
    """W1: one stream with a long prompt, `delay` s later `short_streams` streams with short prompts,
    each generating `new_tokens` tokens (temperature 0.8); /metrics scraped every `interval` s
    (works against any build of the server that exports these gauges)."""
    text = "".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(400))

    def stream(prompt: str, seed: int) -> str:
        request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=new_tokens, temperature=0.8, seed=seed)
        return "".join(chunk.text for chunk in server.stub.GenerateStream(request, timeout=900))

    samples: list[dict[str, float]] = []
    done = threading.Event()
    gauges = [g for g in W1_GAUGES if g != "posenc_kv_cache_physical_peak_bytes"]

    def scrape() -> None:
        while not done.is_set():
            samples.append(server.sample(gauges, model=model))
            time.sleep(interval)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    with ThreadPoolExecutor(short_streams + 1) as pool:
        futures = [pool.submit(stream, text[:long_prompt_bytes], 0)]
        time.sleep(delay)
        futures += [pool.submit(stream, text[i * 7 : i * 7 + short_prompt_bytes], i + 1) for i in range(short_streams)]
        texts = [f.result() for f in futures]
    done.set()
    scraper.join()
    final = server.sample(gauges, model=model)
    peaks = [s["posenc_kv_cache_physical_bytes"] for s in samples]
    try:  # the store's own high-water mark (counts re-allocations between scrapes)
        peaks.append(server.metric("posenc_kv_cache_physical_peak_bytes", model=model))
    except KeyError:
        pass  # a build without the store
    return MixedLengthsFigures(samples, max(peaks), final["posenc_kv_cache_capacity_bytes"], texts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.bench", description=__doc__, formatter_class=HelpFormatter)
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
    if "fused" in args.sections:
        print_fused_steps(folders, args, steps)
    return 0


def single_stream_figures(
    args: argparse.Namespace, repository: Path, server: ServerProcess, server_threads: int
) -> dict[str, float]:
    """Decode tokens/s of one stream through each layer, one after the other (one round). Each is
    the median of three runs: the machine is noisy and one run can land on a busy moment."""
    folder = repository / args.model
    figures = {
        "gRPC": median_of(lambda: decode_tokens_per_second_grpc(server, args.model, args.new_tokens)),
        "engine core": decode_tokens_per_second_core(repository, args.model, args.new_tokens, server_threads),
        "in-process engine": decode_tokens_per_second_engine(repository, args.model, args.new_tokens, server_threads),
        "runner": median_of(
            lambda: decode_tokens_per_second_runner(folder, args.new_tokens, args.threads, args.device)
        ),
        "session.run loop": median_of(
            lambda: decode_tokens_per_second_plain_loop(folder, args.new_tokens, args.threads)
        ),
    }
    genai = median_of(lambda: decode_tokens_per_second_genai(folder, args.new_tokens, args.threads) or math.nan)
    if not math.isnan(genai):
        figures["onnxruntime-genai"] = genai
    return figures


def print_throughput(
    args: argparse.Namespace, repository: Path, server_threads: int, device_flags: list[str], steps: int
) -> None:
    folder = repository / args.model
    print(
        f"\nSingle-stream decode, {args.new_tokens} tokens, model {args.model}, {args.threads} decode threads "
        "(gRPC: the service; engine core: its core process read through its client, no gRPC; in-process "
        "engine: the engine and its reader in one process; runner: the core's graph calls and KV store alone; "
        f"session.run loop: model.onnx in a plain loop; onnxruntime-genai: model.onnx, {args.threads} thread(s)):"
    )
    server = ServerProcess(
        repository, "--models", args.model, "--max-new-tokens-limit", "4096", *device_flags, threads=server_threads
    )
    try:
        server.wait_serving()
        decode_tokens_per_second_grpc(server, args.model, 16)  # warm-up
        rounds = [single_stream_figures(args, repository, server, server_threads) for _ in range(args.rounds)]
        figures = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
        for name, value in figures.items():
            print(f"  {name:<30} {value:8.1f} tokens/s")
        if args.rounds > 1:
            print(f"  (figures and ratios: medians of {args.rounds} interleaved rounds)")
        ratios = [
            ("gRPC", "onnxruntime-genai", "(goal >= 0.8, same threads)"),
            ("engine core", "runner", "(goal >= 0.9)"),
            ("in-process engine", "runner", ""),
            ("gRPC", "runner", ""),
            ("gRPC", "session.run loop", ""),
            ("gRPC", "engine core", ""),
        ]
        for top, bottom, goal in ratios:
            if all(bottom in r and top in r for r in rounds):
                ratio = statistics.median(r[top] / r[bottom] for r in rounds)
                print(f"  {top + ' / ' + bottom:<36} {ratio:.2f}  {goal}".rstrip())
        grpc_rate = figures["gRPC"]
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
            f"{args.new_tokens // 2} new tokens back to back, prefills included; medians of {args.rounds} "
            "interleaved sweeps):"
        )
        # One sweep lasts seconds and the machine drifts by +-15% from minute to minute: each figure
        # is the median of `rounds` sweeps over every concurrency, as the single-stream ones are, and
        # the graph ceiling is measured right after each sweep (the server idle), so that every
        # sweep's 16-stream ratio is taken against a ceiling of the same minute.
        one_runner, sixteen_runner = (batch_runner(folder, batch, 128, args.threads, args.device) for batch in (1, 16))

        def graph_steps() -> tuple[float, float]:
            pairs = [(step_seconds(one_runner, steps * 5), step_seconds(sixteen_runner, steps * 5)) for _ in range(3)]
            one, sixteen = (statistics.median(times) for times in zip(*pairs, strict=True))
            return one, sixteen

        sweeps, graphs = [], []
        for _ in range(args.rounds):
            sweeps.append(
                {streams: aggregate_tokens_per_second(server, args.model, streams, args.new_tokens // 2)
                 for streams in args.concurrency}
            )  # fmt: skip
            graphs.append(graph_steps())
        rates = {streams: statistics.median(sweep[streams] for sweep in sweeps) for streams in args.concurrency}
        for streams in args.concurrency:
            print(
                f"  {streams:>3} streams  {rates[streams]:8.1f} tokens/s   "
                f"{rates[streams] / rates[args.concurrency[0]]:5.2f}x"
            )
    finally:
        server.stop()
    ceilings = [16 * one / sixteen for one, sixteen in graphs]
    one, sixteen = (statistics.median(times) for times in zip(*graphs, strict=True))
    print(
        f"  graph alone (runner, context 128, after each sweep): step {one * 1000:.3f} ms at batch 1, "
        f"{sixteen * 1000:.3f} ms at batch 16, so 16 streams can be at most {statistics.median(ceilings):.2f}x "
        f"one stream here (sweeps: {', '.join(f'{c:.2f}' for c in ceilings)})"
    )
    first = args.concurrency[0]
    if first == 1 and 16 in rates:
        each = [sweep[16] / sweep[1] / ceiling for sweep, ceiling in zip(sweeps, ceilings, strict=True)]
        print(
            f"  16-stream aggregate / graph ceiling  {statistics.median(each):.2f}  (goal >= 0.9; sweeps: "
            f"{', '.join(f'{r:.2f}' for r in each)})"
        )
    if 16 in rates and 64 in rates:
        each = [sweep[64] / sweep[16] for sweep in sweeps]
        print(
            f"  64 streams / 16 streams              {statistics.median(each):.2f}  (goal >= 1; sweeps: "
            f"{', '.join(f'{r:.2f}' for r in each)})"
        )
    server = ServerProcess(repository, "--models", args.model, "--max-new-tokens-limit", "4096", "--prefill-nice", "0",
                           *device_flags, threads=server_threads)  # fmt: skip
    try:
        print_interference(
            "prefill worker at the same priority", prefill_interference(server.wait_serving(), args.model)
        )
    finally:
        server.stop()


def print_step_table(folders: list[Path], args: argparse.Namespace, steps: int) -> None:
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
        if manifest.is_scaling_variant:
            continue
        cells = []
        for text in names:
            policy = parse_cache_policy(text)
            if manifest.max_positions is not None and POLICY_HISTORY >= manifest.max_positions:
                cells.append(f"{'not servable':>22}")
                continue
            try:
                one = policy_runner(folder, 1, POLICY_HISTORY, policy, args.threads, args.device)
            except (AssertionError, ValueError) as error:  # an export without this policy
                cells.append(f"{'n/a':>22}")
                logger.debug("%s %s: %s", manifest.name, text, error)
                continue
            eight = policy_runner(folder, 8, POLICY_HISTORY, policy, args.threads, args.device)
            timing = bounded_step_seconds if policy.bounded else step_seconds
            per_sequence = one.store.stats().physical_bytes
            cells.append(
                f"{timing(one, steps) * 1000:6.2f} /{timing(eight, steps) * 1000:6.2f} {per_sequence / 1e6:5.2f}MB"
            )
        print(f"  {manifest.name:<12}" + "".join(cells))


def print_cache_share(folder: Path, args: argparse.Namespace, steps: int) -> None:
    print("\nCache handling share of decode step time, batch 8, context 2048 (goal <= 20%):")
    share = cache_share(folder, 8, 2048, args.threads, steps, args.device)
    print(
        f"  {'KV store, in-place serving graph':<34} step {share['step_ms']:7.2f} ms   store writes "
        f"{share['host_cache_ms']:6.2f} ms   KV Concat {share['kv_concat_ms']:6.2f} ms   "
        f"share {share['share'] * 100:5.1f}%"
    )


def print_mixed_lengths(
    repository: Path, model: str, server_threads: int, device_flags: list[str], quick: bool
) -> None:
    new_tokens = 200 if quick else 1000
    print(
        f"\nMixed lengths (W1), model {model}, default cache flags: one stream with a 3000-byte prompt, 1.5 s later "
        f"15 streams with 50-byte prompts, {new_tokens} new tokens each (temperature 0.8), /metrics every 50 ms:"
    )
    server = ServerProcess(repository, "--models", model, *device_flags, threads=server_threads)
    try:
        figures = mixed_lengths_workload(server.wait_serving(), model, new_tokens=new_tokens)
    finally:
        server.stop()
    print(
        f"  used/physical (median, >= 8 running) {figures.used_over_physical:5.2f}   (goal >= 0.8)\n"
        f"  peak physical {figures.peak_physical / 2**20:7.1f} MiB   budget {figures.capacity / 2**20:7.1f} MiB   "
        f"({'within' if figures.peak_physical <= figures.capacity else 'ABOVE'} the budget)\n"
        f"  decode step of the mixed batch (mean, >= 8 running) {figures.decode_step_seconds * 1000:6.2f} ms"
    )
    return 0


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
        if manifest.is_scaling_variant or manifest.fused_attention is None:
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


if __name__ == "__main__":
    raise SystemExit(main())
