"""The real server on loopback, called with a real gRPC client."""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from export.runtime import OnnxCausalLM
from models.checkpoints import trained_schemes
from models.tokenizer import TOKENIZER
from service.api import generation_pb2 as pb
from service.process import ServerProcess, wait_for

TRAINED = trained_schemes()  # the schemes with shipped weights: what the repository fixture exports

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Parser:\n    def __init__(self, text):\n        self.text = text\n",
    "for i in range(10):\n",
    '# Copyright 2001 Python Software Foundation\n"""Utilities for the',
    "x",
]


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository, "--max-new-tokens-limit", "2048").wait_serving()
    yield process
    process.stop()


def offline_greedy_text(repository: Path, model: str, prompt: str, max_new_tokens: int) -> tuple[str, str]:
    """ONNX Runtime alone: greedy tokens until EOS or the limit -> (text, finish reason)."""
    tokens, _ = OnnxCausalLM(repository / model).greedy([TOKENIZER.encode(prompt)], max_new_tokens)
    out = tokens[0]
    reason = "length"
    if TOKENIZER.eos_token_id in out:
        out, reason = out[: out.index(TOKENIZER.eos_token_id)], "eos"
    return TOKENIZER.decode(out), reason


def test_health_and_reflection(server: ServerProcess) -> None:
    for service in ("", "posenc.v1.Generation"):
        response = server.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    database = ProtoReflectionDescriptorDatabase(server.channel)
    services = database.get_services()
    assert "posenc.v1.Generation" in services and "grpc.health.v1.Health" in services
    descriptor = database.FindFileContainingSymbol("posenc.v1.Generation")
    assert descriptor.package == "posenc.v1"


def test_list_models_reports_limits_and_cache_cost(server: ServerProcess) -> None:
    models = {m.name: m for m in server.stub.ListModels(pb.ListModelsRequest(), timeout=5).models}
    assert set(models) >= set(TRAINED)
    assert models["learned"].max_positions == 256 and models["alibi"].max_positions == 0
    for model in models.values():
        whole = 2 * model.n_layers * model.n_heads * model.head_dim * 4  # K and V of every layer, float32
        if model.scheme == "mla":  # one [latent (d_model / 2); rotated key (head_dim / 2)] a layer
            latent = model.n_heads * model.head_dim // 2 + model.head_dim // 2
            assert (model.kv_cache_bytes_per_token, model.kv_cache_bytes_per_sequence) == (
                model.n_layers * latent * 4, 0,
            ), model.name  # fmt: skip
        elif model.kv_cache_bytes_per_sequence == 0:  # whole rows
            assert model.kv_cache_bytes_per_token == whole, model.name
        else:  # split rows: the global layers' a token, the local layers' in fixed columns
            local = whole - model.kv_cache_bytes_per_token
            assert 0 < local < whole and model.kv_cache_bytes_per_sequence % local == 0, model.name
        assert model.train_context == 256 and model.kv_cache_capacity_bytes > 0
    split = {name: model for name, model in models.items() if model.kv_cache_bytes_per_sequence}
    if split:  # an export with per-group caches: the hybrids' 1 global and 3 local layers, 144 columns
        assert set(split) == {"rnope-swa", "rope-swa"}
        for model in split.values():
            assert (model.kv_cache_bytes_per_token, model.kv_cache_bytes_per_sequence) == (1024, 442368)


@pytest.mark.parametrize("scheme", TRAINED)
def test_greedy_through_the_service_equals_offline_onnx_runtime(
    server: ServerProcess, repository: Path, scheme: str
) -> None:
    prompt = "def parse_args(argv):\n    parser = "
    response = server.stub.Generate(pb.GenerateRequest(model=scheme, prompt=prompt, max_new_tokens=60), timeout=60)
    expected, reason = offline_greedy_text(repository, scheme, prompt, 60)
    assert response.text == expected
    assert pb.FinishReason.Name(response.finish_reason) == f"FINISH_REASON_{reason.upper()}"
    assert response.usage.prompt_tokens == len(TOKENIZER.encode(prompt))
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert 0 < response.timings.time_to_first_token_seconds <= response.timings.total_seconds


def _stream_text(server: ServerProcess, request: pb.GenerateRequest) -> tuple[str, int]:
    chunks = list(server.stub.GenerateStream(request, timeout=120))
    assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def test_32_concurrent_streams_each_equal_their_single_request_output(server: ServerProcess) -> None:
    rng = np.random.default_rng(3)
    requests = []
    for i in range(32):
        prompt = PROMPTS[i % len(PROMPTS)] * int(rng.integers(1, 4))
        requests.append(
            pb.GenerateRequest(
                model=("alibi", "rope", "relative", "none")[i % 4], prompt=prompt,
                max_new_tokens=int(rng.integers(8, 64)),
                temperature=0.0 if i % 3 else 0.9, top_k=20 if i % 2 else 0, top_p=0.95, seed=i,
            )
        )  # fmt: skip
    alone = [_stream_text(server, r) for r in requests]
    with ThreadPoolExecutor(max_workers=32) as pool:
        together = list(pool.map(lambda r: _stream_text(server, r), requests))
    assert together == alone


def test_sampling_is_seeded_and_reproducible(server: ServerProcess) -> None:
    def sample(seed: int) -> str:
        request = pb.GenerateRequest(model="alibi", prompt="import ", max_new_tokens=40, temperature=1.0, seed=seed)
        return server.stub.Generate(request, timeout=30).text

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_stop_strings_end_generation_before_the_stop(server: ServerProcess) -> None:
    prompt = "def parse_args(argv):\n    parser = "
    full = server.stub.Generate(pb.GenerateRequest(model="rope", prompt=prompt, max_new_tokens=60), timeout=30).text
    stop = full[10:13]
    response = server.stub.Generate(
        pb.GenerateRequest(model="rope", prompt=prompt, max_new_tokens=60, stop=[stop, "never-appears-anywhere"]),
        timeout=30,
    )
    assert response.finish_reason == pb.FINISH_REASON_STOP
    assert response.text == full[: full.index(stop)]
    streamed, reason = _stream_text(
        server, pb.GenerateRequest(model="rope", prompt=prompt, max_new_tokens=60, stop=[stop])
    )
    assert (streamed, reason) == (response.text, pb.FINISH_REASON_STOP)


def test_stream_chunks_are_whole_utf8_characters(server: ServerProcess) -> None:
    # Sampling at a high temperature produces arbitrary bytes, so chunk boundaries fall
    # inside multi-byte characters unless the detokenizer holds them back.
    request = pb.GenerateRequest(model="none", prompt="héllo → ", max_new_tokens=200, temperature=3.0, seed=11)
    chunks = list(server.stub.GenerateStream(request, timeout=60))
    text = "".join(c.text for c in chunks)
    assert text == server.stub.Generate(request, timeout=60).text
    assert all(c.text.encode("utf-8").decode("utf-8") == c.text for c in chunks)


def test_cancelled_stream_returns_cache_to_zero(server: ServerProcess) -> None:
    request = pb.GenerateRequest(model="alibi", prompt="def main():\n", max_new_tokens=2000)
    stream = server.stub.GenerateStream(request, timeout=120)
    for _ in range(5):
        next(stream)
    assert server.metric("posenc_kv_cache_used_bytes", model="alibi") > 0
    stream.cancel()
    assert wait_for(lambda: server.sequence_bytes("posenc_kv_cache_used_bytes", model="alibi") == 0)
    assert wait_for(lambda: server.metric("posenc_running_sequences", model="alibi") == 0)


def test_used_cache_gauge_follows_a_stream_growing_inside_its_row(server: ServerProcess) -> None:
    """Between 1200 and 1504 tokens a sequence grows inside one row, a steady batch that takes no
    scheduling step; the used-bytes gauge still follows it (it is updated every 20 ms), rather than
    holding what the row's last move reserved."""
    info = {m.name: m for m in server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models}["alibi"]
    prompt = "def main():\n"
    stream = server.stub.GenerateStream(
        pb.GenerateRequest(model="alibi", prompt=prompt, max_new_tokens=1500), timeout=120
    )
    received = 0
    for chunk in stream:
        received += len(chunk.text.encode())
        if received >= 1400:
            break
    used = server.metric("posenc_kv_cache_used_bytes", model="alibi")
    stream.cancel()
    held = used / info.kv_cache_bytes_per_token
    # The engine is ahead of what this client has read; the gauge lags it by <= 20 ms of steps.
    assert held >= len(prompt) + 1400 - 100, held


def test_deadline_returns_deadline_exceeded_and_frees_cache(server: ServerProcess) -> None:
    request = pb.GenerateRequest(model="sinusoidal", prompt="class A:\n", max_new_tokens=2000)
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Generate(request, timeout=0.3)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: server.sequence_bytes("posenc_kv_cache_used_bytes", model="sinusoidal") == 0)
    assert wait_for(lambda: server.metric("posenc_running_sequences", model="sinusoidal") == 0)


BAD_REQUESTS = [
    (pb.GenerateRequest(model="nope", prompt="x"), grpc.StatusCode.NOT_FOUND, "model"),
    (pb.GenerateRequest(model="alibi", prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (
        pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_new_tokens",
    ),
    (
        pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=-3),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_new_tokens",
    ),
    (pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=999_999), grpc.StatusCode.INVALID_ARGUMENT, "2048"),
    (pb.GenerateRequest(model="alibi", prompt="x", temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (pb.GenerateRequest(model="alibi", prompt="x", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (pb.GenerateRequest(model="alibi", prompt="x", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (pb.GenerateRequest(model="alibi", prompt="x", top_k=-1), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    (
        pb.GenerateRequest(model="alibi", prompt="x", temperature=math.nan),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    (
        pb.GenerateRequest(model="learned", prompt="x" * 200, max_new_tokens=100),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_positions=256",
    ),
]


@pytest.mark.parametrize(("request_", "code", "names"), BAD_REQUESTS)
def test_bad_input_gets_its_code_and_the_server_keeps_serving(
    server: ServerProcess, request_: pb.GenerateRequest, code: grpc.StatusCode, names: str
) -> None:
    for call in (server.stub.Generate, lambda r, timeout: list(server.stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as error:
            call(request_, timeout=10)
        assert error.value.code() == code
        assert names in error.value.details()
    ok = server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=3), timeout=10)
    assert ok.usage.completion_tokens == 3


def test_score_matches_offline_log_probabilities(server: ServerProcess, repository: Path) -> None:
    text = "def add(a, b):\n    return a + b\n"
    response = server.stub.Score(pb.ScoreRequest(model="relative", text=text), timeout=30)
    offline = OnnxCausalLM(repository / "relative").token_logprobs(TOKENIZER.encode(text))
    np.testing.assert_allclose(response.token_logprobs, offline, atol=1e-4)
    assert response.tokens == len(text.encode())
    assert response.bits_per_byte == pytest.approx(-offline.sum() / math.log(2) / len(offline), rel=1e-5)
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Score(pb.ScoreRequest(model="learned", text="y" * 300), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_positions=256" in error.value.details()
    long = server.stub.Score(pb.ScoreRequest(model="alibi", text="y" * 1000), timeout=30)
    assert long.tokens == 1000


METRIC_NAMES = [
    "posenc_requests_total",
    "posenc_request_duration_seconds_bucket",
    "posenc_time_to_first_token_seconds_bucket",
    "posenc_inter_token_latency_seconds_bucket",
    "posenc_prompt_tokens_total",
    "posenc_generated_tokens_total",
    "posenc_kv_cache_used_bytes",
    "posenc_kv_cache_capacity_bytes",
    "posenc_running_sequences",
    "posenc_queued_sequences",
    "posenc_batch_size_bucket",
    "posenc_step_duration_seconds_bucket",
]


def test_metrics_are_exposed_and_move(server: ServerProcess) -> None:
    before = server.metrics()
    for name in METRIC_NAMES[6:10]:
        assert name in before
    labels = {"model": "none", "scheme": "none"}
    generated = _safe_metric(server, "posenc_generated_tokens_total", **labels)
    server.stub.Generate(pb.GenerateRequest(model="none", prompt="import re\n", max_new_tokens=12), timeout=30)
    after = server.metrics()
    for name in METRIC_NAMES:
        assert name in after, name
    assert server.metric("posenc_generated_tokens_total", **labels) >= generated + 12
    assert server.metric("posenc_requests_total", model="none", code="OK") >= 1
    assert server.metric("posenc_step_duration_seconds_count", model="none", phase="decode") >= 11
    assert server.metric("posenc_step_duration_seconds_count", model="none", phase="prefill") >= 1
    assert server.metric("posenc_kv_cache_capacity_bytes", model="none") > 0


def _safe_metric(server: ServerProcess, name: str, **labels: str) -> float:
    try:
        return server.metric(name, **labels)
    except KeyError:
        return 0.0


def test_full_queue_answers_resource_exhausted_at_once(repository: Path) -> None:
    server = ServerProcess(repository, "--models", "alibi", "--max-batch-size", "1", "--max-queue", "1").wait_serving()
    try:
        request = pb.GenerateRequest(model="alibi", prompt="def f():\n", max_new_tokens=400)
        futures = [server.stub.Generate.future(request, timeout=120) for _ in range(6)]
        codes = []
        for future in futures:
            try:
                future.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    assert "max_queue=1" in error.details()
                    hint = dict(error.trailing_metadata() or ())["retry-after-ms"]  # when the queue will have drained
                    assert 0 < int(hint) <= 5000
        assert codes.count(grpc.StatusCode.OK) >= 2
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
        assert wait_for(lambda: server.sequence_bytes("posenc_kv_cache_used_bytes", model="alibi") == 0)
    finally:
        server.stop()


def test_sigterm_drains_running_work_then_refuses(repository: Path) -> None:
    server = ServerProcess(repository, "--models", "rope", "--grace-seconds", "20").wait_serving()
    request = pb.GenerateRequest(model="rope", prompt="def f():\n", max_new_tokens=300)
    stream = server.stub.GenerateStream(request, timeout=60)
    next(stream)
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.setdefault("chunks", list(stream)))
    thread.start()
    server.process.send_signal(signal.SIGTERM)
    thread.join(timeout=60)
    chunks = result["chunks"]
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH  # type: ignore[index]
    assert server.process.wait(timeout=30) == 0
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Generate(request, timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    server.stop()


def test_tampered_model_file_refuses_start_naming_the_file(repository: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(repository / "none", tmp_path / "none")
    onnx_file = tmp_path / "none" / "model.onnx"
    onnx_file.write_bytes(onnx_file.read_bytes()[:-10])
    server = ServerProcess(tmp_path)
    assert server.process.wait(timeout=60) == 2
    output = server.output()
    assert "refusing to start" in output and str(onnx_file) in output and "sha256" in output
    server.stop()
