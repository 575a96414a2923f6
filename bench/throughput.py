"""The throughput section: single-stream decode through each layer and their ratios, gRPC
transport alone, aggregate tokens/s at several concurrencies against the graph's own ceiling,
and a running stream's inter-token latency while a long prompt is prefilled."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.layers import (
    decode_tokens_per_second_core,
    decode_tokens_per_second_engine,
    decode_tokens_per_second_genai,
    decode_tokens_per_second_grpc,
    decode_tokens_per_second_http,
    decode_tokens_per_second_plain_loop,
    decode_tokens_per_second_runner,
    grpc_stream_ceiling,
    http_completion,
    unique_prompt_tokens_per_second,
)
from bench.runners import batch_runner, step_seconds
from bench.streams import median_of, stream_texts, token_arrivals
from service.api import generation_pb2 as pb
from service.process import ServerProcess

REQUESTS_PER_STREAM = 4  # aggregate throughput: unary requests each stream sends back to back
MISSES = "gRPC, unique 512-byte prompts"  # prefix-cache misses (prefill included)
UNCACHED = "the same, prefix cache off"
_SALTS = itertools.count()  # unique prompts across rounds too (a repeat would be a prefix-cache hit)


def print_throughput(
    args: argparse.Namespace, repository: Path, server_threads: int, device_flags: list[str], steps: int
) -> None:
    """Print the throughput section; one server serves every figure but the last, which needs its
    prefill worker at the engine's own priority."""
    print(
        f"\nSingle-stream decode, {args.new_tokens} tokens, model {args.model}, {args.threads} decode threads "
        "(gRPC: the service; engine core: its core process read through its client, no gRPC; in-process "
        "engine: the engine and its reader in one process; runner: the core's graph calls and KV store alone; "
        f"session.run loop: model.onnx in a plain loop; onnxruntime-genai: model.onnx, {args.threads} thread(s)):"
    )
    server = ServerProcess(
        repository, "--models", args.model, "--max-new-tokens-limit", "4096", *device_flags, threads=server_threads
    )
    # The same server without its prefix cache, for what a miss costs (idle while the others run).
    uncached = ServerProcess(
        repository, "--models", args.model, "--max-new-tokens-limit", "4096", "--no-prefix-cache", *device_flags,
        threads=server_threads,
    )  # fmt: skip
    try:
        server.wait_serving()
        uncached.wait_serving()
        decode_tokens_per_second_grpc(server, args.model, 16)  # warm-up
        decode_tokens_per_second_grpc(uncached, args.model, 16)
        print_single_stream(args, repository, server, server_threads, uncached)
        interference = prefill_interference(server, args.model)
        print_interference("prefill worker at nice +10 (default)", interference)
        print(
            f"\nAggregate throughput through gRPC (each stream: {REQUESTS_PER_STREAM} unary requests of "
            f"{args.new_tokens // 2} new tokens back to back, prefills included; medians of {args.rounds} "
            "interleaved sweeps):"
        )
        sweeps = aggregate_sweeps(args, repository, server, steps)
    finally:
        server.stop()
        uncached.stop()
    print_against_the_graph(args, sweeps)
    server = ServerProcess(repository, "--models", args.model, "--max-new-tokens-limit", "4096", "--prefill-nice", "0",
                           *device_flags, threads=server_threads)  # fmt: skip
    try:
        print_interference(
            "prefill worker at the same priority", prefill_interference(server.wait_serving(), args.model)
        )
    finally:
        server.stop()


def print_single_stream(
    args: argparse.Namespace, repository: Path, server: ServerProcess, server_threads: int, uncached: ServerProcess
) -> None:
    """Single-stream decode through each layer (medians of interleaved rounds), their ratios against
    their goals, and what gRPC transport alone costs per token."""
    rounds = [single_stream_figures(args, repository, server, server_threads, uncached) for _ in range(args.rounds)]
    figures = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    for name, value in figures.items():
        print(f"  {name:<30} {value:8.1f} tokens/s")
    if args.rounds > 1:
        print(f"  (figures and ratios: medians of {args.rounds} interleaved rounds)")
    ratios = [
        ("gRPC", "onnxruntime-genai", "(goal >= 0.8, same threads)"),
        ("HTTP", "gRPC", "(goal >= 0.9: /v1/completions streaming, ignore_eos)"),
        (WITH_LOGPROBS, "gRPC", "(what each token's log-probability and 5 alternatives cost)"),
        (MISSES, UNCACHED, "(goal >= 0.97: a prefix-cache miss costs no more than no cache)"),
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


@dataclass
class Sweeps:
    """Aggregate tokens/s by concurrency, one dict per sweep; the graph's step times (batch 1, 16, 64)
    measured after each; the 64 HTTP streams' rate per sweep (when 64 is swept); and the medians."""

    sweeps: list[dict[int, float]]
    graphs: list[tuple[float, float, float]]
    http64: list[float]
    rates: dict[int, float]


def aggregate_sweeps(args: argparse.Namespace, repository: Path, server: ServerProcess, steps: int) -> Sweeps:
    """Sweep every concurrency `args.rounds` times, each sweep followed by the graph alone; print the
    median rate of each concurrency."""
    # One sweep lasts seconds and a shared machine's speed drifts from minute to minute: each figure
    # is the median of `rounds` sweeps over every concurrency, as the single-stream ones are, and
    # the graph ceiling is measured right after each sweep (the server idle), so that every
    # sweep's 16-stream ratio is taken against a ceiling of the same minute.
    # Batch 64 too: how far the graph's own cost per token still falls past 16 rows bounds what 64
    # streams can gain over 16.
    folder = repository / args.model
    runners = [batch_runner(folder, batch, 128, args.threads, args.device) for batch in (1, 16, 64)]

    def graph_steps() -> tuple[float, float, float]:
        rounds = [tuple(step_seconds(runner, steps * 5) for runner in runners) for _ in range(3)]
        one, sixteen, sixty_four = (statistics.median(times) for times in zip(*rounds, strict=True))
        return one, sixteen, sixty_four

    sweeps, graphs, http64 = [], [], []
    for _ in range(args.rounds):
        sweeps.append(
            {streams: aggregate_tokens_per_second(server, args.model, streams, args.new_tokens // 2)
             for streams in args.concurrency}
        )  # fmt: skip
        if 64 in args.concurrency:  # the same 64 clients through the HTTP API
            http64.append(aggregate_tokens_per_second(server, args.model, 64, args.new_tokens // 2, http=True))
        graphs.append(graph_steps())
    rates = {streams: statistics.median(sweep[streams] for sweep in sweeps) for streams in args.concurrency}
    for streams in args.concurrency:
        print(
            f"  {streams:>3} streams  {rates[streams]:8.1f} tokens/s   "
            f"{rates[streams] / rates[args.concurrency[0]]:5.2f}x"
        )
    return Sweeps(sweeps, graphs, http64, rates)


def print_against_the_graph(args: argparse.Namespace, measured: Sweeps) -> None:
    """The graph's own ceiling for 16 and 64 streams, and each sweep's aggregate against it and HTTP's
    against gRPC's."""
    sweeps, graphs, http64, rates = measured.sweeps, measured.graphs, measured.http64, measured.rates
    ceilings = [16 * one / sixteen for one, sixteen, _ in graphs]
    one, sixteen, sixty_four = (statistics.median(times) for times in zip(*graphs, strict=True))
    print(
        f"  graph alone (runner, context 128, after each sweep): step {one * 1000:.3f} ms at batch 1, "
        f"{sixteen * 1000:.3f} ms at batch 16, so 16 streams can be at most {statistics.median(ceilings):.2f}x "
        f"one stream here (sweeps: {', '.join(f'{c:.2f}' for c in ceilings)}); {sixty_four * 1000:.3f} ms at "
        f"batch 64, so 64 streams at most {4 * sixteen / sixty_four:.2f}x 16"
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
            f"  64 streams / 16 streams              {statistics.median(each):.2f}  (goal >= 1; the graph alone "
            f"{4 * sixteen / sixty_four:.2f}; sweeps: {', '.join(f'{r:.2f}' for r in each)})"
        )
    if http64:
        each = [http / sweep[64] for http, sweep in zip(http64, sweeps, strict=True)]
        print(
            f"  64 HTTP streams {statistics.median(http64):8.1f} tokens/s; "
            f"HTTP / gRPC at 64 streams {statistics.median(each):.2f}  (goal >= 0.9; /v1/completions, same requests; "
            f"sweeps: {', '.join(f'{r:.2f}' for r in each)})"
        )


LOGPROBS = 5
WITH_LOGPROBS = f"gRPC, logprobs {LOGPROBS}"


def single_stream_figures(
    args: argparse.Namespace, repository: Path, server: ServerProcess, server_threads: int, uncached: ServerProcess
) -> dict[str, float]:
    """Decode tokens/s of one stream through each layer, one after the other (one round). Each is
    the median of three runs: the machine is noisy and one run can land on a busy moment. `uncached`:
    the server without its prefix cache; unique prompts on both, alternated, price a miss."""
    folder = repository / args.model
    rates: dict[str, list[float]] = {MISSES: [], UNCACHED: []}
    for pair in range(12):  # alternated, each server first in every other pair
        order = [(MISSES, server), (UNCACHED, uncached)]
        for name, target in order if pair % 2 == 0 else order[::-1]:
            rates[name].append(unique_prompt_tokens_per_second(target, args.model, args.new_tokens // 4, next(_SALTS)))
    # What asking for log-probabilities costs: plain and `logprobs: 5` streams alternated, three each.
    plain, scored = [], []
    for pair in range(3):
        for logprobs in (None, LOGPROBS) if pair % 2 == 0 else (LOGPROBS, None):
            rate = decode_tokens_per_second_grpc(server, args.model, args.new_tokens, logprobs)
            (plain if logprobs is None else scored).append(rate)
    figures = {
        MISSES: statistics.median(rates[MISSES]),
        UNCACHED: statistics.median(rates[UNCACHED]),
        "gRPC": statistics.median(plain),
        WITH_LOGPROBS: statistics.median(scored),
        "HTTP": median_of(lambda: decode_tokens_per_second_http(server, args.model, args.new_tokens)),
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


def aggregate_tokens_per_second(
    server: ServerProcess,
    model: str,
    streams: int,
    new_tokens: int,
    requests_per_stream: int = REQUESTS_PER_STREAM,
    http: bool = False,
) -> float:
    """Generated tokens/s of `streams` clients, each sending unary requests back to back, so
    every concurrency (one stream too) is measured over several requests, prefills included.
    `http`: the same requests as non-streaming /v1/completions calls."""

    def client(stream: int) -> int:
        tokens = 0
        for i in range(requests_per_stream):
            prompt = f"def function_{stream}_{i}(x):\n    return x * {i}\n\n"
            if http:
                body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.8, "seed": i}
                tokens += json.loads(http_completion(server, body).read())["usage"]["completion_tokens"]
                continue
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
