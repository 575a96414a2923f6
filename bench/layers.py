"""Decode tokens/s of one stream through each layer of the service, from gRPC down to a plain
session.run loop and onnxruntime-genai on the same ONNX files; and gRPC transport alone."""

from __future__ import annotations

import http.client
import json
import math
import statistics
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
from prometheus_client import CollectorRegistry

from bench.prefill import genai_model, prompt_text
from bench.streams import decode_rate, median_of, output_texts, stream_texts, token_arrivals
from contract.manifest import Manifest
from export.runtime import OnnxCausalLM
from models.tokenizer import TOKENIZER
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.engine.engine import Engine
from service.engine.messages import EngineConfig, GenerateInput
from service.engine.prompts.prompt import PromptRun
from service.engine.worker.runner import ModelRunner, StoreConfig
from service.engine_client import EngineClient
from service.metrics import ServiceMetrics
from service.process import ServerProcess


def decode_tokens_per_second_grpc(
    server: ServerProcess, model: str, new_tokens: int, logprobs: int | None = None
) -> float:
    """One stream's decode rate; `logprobs`: each token's log-probability and that many alternatives too."""
    request = pb.GenerateRequest(model=model, prompt="def main():\n", max_new_tokens=new_tokens, logprobs=logprobs)
    return decode_rate(token_arrivals(stream_texts(server.stub.GenerateStream(request, timeout=600))))


def decode_tokens_per_second_grpc_counted(server: ServerProcess, model: str, new_tokens: int) -> float:
    """One stream's decode rate, every token counted (usage) rather than read off the text: random
    weights emit any byte, and an invalid UTF-8 byte arrives as a 3-byte replacement character or
    not at all. `ignore_eos`, so every run decodes `new_tokens`; the first chunk is the prefill's token."""
    request = pb.GenerateRequest(model=model, prompt="def main():\n", max_new_tokens=new_tokens, ignore_eos=True)
    arrivals, tokens = [], 0
    for chunk in server.stub.GenerateStream(request, timeout=600):
        arrivals.append(time.perf_counter())
        tokens = chunk.usage.completion_tokens or tokens
    return (tokens - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else math.nan


def unique_prompt_tokens_per_second(server: ServerProcess, model: str, new_tokens: int, salt: int) -> float:
    """Tokens/s of one greedy request, prefill included, whose 512-byte prompt no other request
    shares (`new_tokens` exactly: ignore_eos): with the prefix cache on, a miss whose blocks are
    hashed, looked up and kept; with it off, the same work without the cache."""
    request = pb.GenerateRequest(model=model, prompt=prompt_text(512, salt), max_new_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    server.stub.Generate(request, timeout=600)
    return new_tokens / (time.perf_counter() - started)


def http_completion(server: ServerProcess, body: dict[str, object]) -> http.client.HTTPResponse:
    """POST /v1/completions on the server's OpenAI-compatible API; the response, unread."""
    address = urllib.parse.urlsplit(server.http_url)
    connection = http.client.HTTPConnection(address.hostname or "127.0.0.1", address.port, timeout=600)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"/v1/completions answered {response.status}: {response.read()[:300]!r}")
    return response


def sse_texts(response: http.client.HTTPResponse) -> Iterator[str]:
    """The completion text of each server-sent event of a /v1/completions stream."""
    for line in response:
        if line.startswith(b"data: {"):
            choices = json.loads(line[6:])["choices"]
            if choices:
                yield choices[0]["text"]


def decode_tokens_per_second_http(server: ServerProcess, model: str, new_tokens: int) -> float:
    """One stream through the OpenAI-compatible API: /v1/completions streaming, greedy, ignore_eos."""
    body = {"model": model, "prompt": "def main():\n", "max_tokens": new_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}  # fmt: skip
    return decode_rate(token_arrivals(sse_texts(http_completion(server, body))))


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
    ids = TOKENIZER.encode("def main():\n")
    *_, [prompt] = runner.prefill([PromptRun("r", ids)], len(ids))
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
    """onnxruntime-genai's own loop on the same model.onnx, with `threads` intra-op threads (as ours);
    None where genai_model is."""
    if (opened := genai_model(folder, threads)) is None:
        return None
    og, model = opened
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
