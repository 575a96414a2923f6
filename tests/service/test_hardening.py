"""Hostile input, cancellation storms, overload and restarts against the real server."""

from __future__ import annotations

import random
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import service.process
from service.api import generation_pb2 as pb
from service.process import ServerProcess, free_port, wait_for

MODELS = ("alibi", "learned")
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(
        repository, "--models", *MODELS, "--max-new-tokens-limit", "32", "--max-queue", "512"
    ).wait_serving()
    yield process
    process.stop()


def cache_is_empty(server: ServerProcess) -> bool:
    return all(
        server.sequence_bytes("posenc_kv_cache_used_bytes", model=m) == 0
        and server.metric("posenc_running_sequences", model=m) == 0
        and server.metric("posenc_queued_sequences", model=m) == 0
        for m in MODELS
    )


def assert_completed(response: pb.GenerateResponse, prompt: str, max_new_tokens: int) -> None:
    """A greedy request that ran to its token limit: all its tokens counted, some text out."""
    assert response.finish_reason == pb.FINISH_REASON_LENGTH, pb.FinishReason.Name(response.finish_reason)
    assert response.usage.completion_tokens == max_new_tokens
    assert response.usage.prompt_tokens == len(prompt.encode()) + 1  # bytes and BOS
    assert response.usage.total_tokens == response.usage.prompt_tokens + max_new_tokens
    assert response.text


# Hostile inputs of every kind the fuzz tests draw, fixed so a test can run them itself.
NAN, INF = float("nan"), float("inf")
HOSTILE_GENERATE_REQUESTS = [
    pb.GenerateRequest(model="nope", prompt="x", max_new_tokens=2),
    pb.GenerateRequest(model="", prompt="x", max_new_tokens=2),
    pb.GenerateRequest(model="x" * 300, prompt="x"),
    pb.GenerateRequest(model="é", prompt="x"),
    pb.GenerateRequest(model="alibi", prompt=""),
    pb.GenerateRequest(model="learned", prompt="\x00" * 10, max_new_tokens=5),
    pb.GenerateRequest(model="learned", prompt="y" * 400, max_new_tokens=32),  # past max_positions
    pb.GenerateRequest(model="alibi", prompt="y" * 400, max_new_tokens=32),
    pb.GenerateRequest(model="alibi", prompt="é→😀\ud7ff", max_new_tokens=0),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=-1),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=-(2**31)),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=2**31 - 1),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=33),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=NAN),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=INF),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=-INF),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=-0.5),
    pb.GenerateRequest(model="learned", prompt="x", max_new_tokens=32, temperature=1e-30, seed=2**64 - 1),
    pb.GenerateRequest(model="learned", prompt="x", max_new_tokens=32, temperature=1e30, seed=1),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=0.7, top_k=-(2**31)),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=0.7, top_k=2**31 - 1),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=0.7, top_p=NAN),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=0.7, top_p=INF),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=0.7, top_p=0.0),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=0.7, top_p=-1.0),
    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=32, temperature=0.7, top_p=1e-9, top_k=1),
    pb.GenerateRequest(model="learned", prompt="x", max_new_tokens=32, temperature=0.7, top_p=1.5),
    pb.GenerateRequest(model="alibi", prompt="def f(", max_new_tokens=32, stop=[""]),
    pb.GenerateRequest(model="alibi", prompt="def f(", max_new_tokens=32, stop=["\n", "", "é" * 40, "\x00"]),
    pb.GenerateRequest(model="learned", prompt="import os\n" * 20, max_new_tokens=32, temperature=0.9, seed=3),
]
HOSTILE_SCORE_REQUESTS = [
    pb.ScoreRequest(model="alibi", text=""),
    pb.ScoreRequest(model="zzz", text="x"),
    pb.ScoreRequest(model="", text="x"),
    pb.ScoreRequest(model="learned", text="y" * 600),  # past max_positions
    pb.ScoreRequest(model="alibi", text="y" * 600),
    pb.ScoreRequest(model="alibi", text="\x00é😀"),
    pb.ScoreRequest(model="learned", text="x"),
]


floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
generate_requests = st.builds(
    pb.GenerateRequest,
    model=st.sampled_from([*MODELS, "", "nope", "x" * 300, "é"]),
    prompt=st.one_of(st.text(max_size=300), st.just(""), st.just("\x00" * 10), st.just("y" * 400)),
    max_new_tokens=st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1), st.integers(-3, 40)),
    temperature=st.one_of(floats, st.sampled_from([0.0, 1e-30, 1e30, 0.7])),
    top_k=st.integers(-(2**31), 2**31 - 1),
    top_p=st.one_of(st.none(), floats, st.sampled_from([1e-9, 0.5, 1.0])),
    seed=st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=40), max_size=4),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=generate_requests, streaming=st.booleans())
def test_fuzzed_generate_requests_end_with_a_defined_status(server: ServerProcess, request, streaming: bool) -> None:  # type: ignore[no-untyped-def]
    try:
        if streaming:
            chunks = list(server.stub.GenerateStream(request, timeout=60))
            assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        else:
            response = server.stub.Generate(request, timeout=60)
            assert response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            assert response.usage.completion_tokens <= 32
    except grpc.RpcError as error:
        assert error.code() in ALLOWED, (error.code(), error.details())
        assert error.details()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from([*MODELS, "", "zzz"]), text=st.one_of(st.text(max_size=600), st.just("")))
def test_fuzzed_score_requests_end_with_a_defined_status(server: ServerProcess, model: str, text: str) -> None:
    try:
        response = server.stub.Score(pb.ScoreRequest(model=model, text=text), timeout=60)
        assert response.tokens == len(text.encode()) and len(response.token_logprobs) == response.tokens
    except grpc.RpcError as error:
        assert error.code() in ALLOWED, (error.code(), error.details())


def test_after_hostile_requests_server_is_healthy_and_cache_empty(server: ServerProcess) -> None:
    """Runs its own hostile inputs (unary, streamed, streams dropped early, concurrently), so it
    does not depend on the fuzz tests having run before it."""
    good = pb.GenerateRequest(model="alibi", prompt="def ok():\n", max_new_tokens=16)
    before = server.stub.Generate(good, timeout=60)
    assert_completed(before, good.prompt, 16)
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def run(call) -> None:  # type: ignore[no-untyped-def]
        try:
            call()
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            assert error.code() in ALLOWED, (error.code(), error.details())
            assert error.details()
            code = error.code()
        with lock:
            codes.append(code)

    def unary(request: pb.GenerateRequest) -> None:
        response = server.stub.Generate(request, timeout=60)
        assert response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert response.usage.completion_tokens <= 32

    def streamed(request: pb.GenerateRequest) -> None:
        chunks = list(server.stub.GenerateStream(request, timeout=60))
        assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert chunks[-1].usage.completion_tokens <= 32

    def dropped(request: pb.GenerateRequest) -> None:  # the client goes away after one chunk
        stream = server.stub.GenerateStream(request, timeout=60)
        try:
            next(stream)
        except StopIteration:
            pass
        stream.cancel()

    def score(request: pb.ScoreRequest) -> None:
        response = server.stub.Score(request, timeout=60)
        assert response.tokens == len(request.text.encode()) == len(response.token_logprobs)

    calls = [
        *(lambda r=r: unary(r) for r in HOSTILE_GENERATE_REQUESTS),
        *(lambda r=r: streamed(r) for r in HOSTILE_GENERATE_REQUESTS),
        *(lambda r=r: dropped(r) for r in HOSTILE_GENERATE_REQUESTS),
        *(lambda r=r: score(r) for r in HOSTILE_SCORE_REQUESTS),
    ]
    for call in calls[:: len(calls) // 10]:  # a few one at a time, then all at once
        run(call)
    with ThreadPoolExecutor(max_workers=16) as pool:
        for job in [pool.submit(run, call) for call in calls]:
            job.result()
    # Both paths were exercised: some inputs are rejected, some are served.
    assert grpc.StatusCode.OK in codes and grpc.StatusCode.INVALID_ARGUMENT in codes
    assert grpc.StatusCode.NOT_FOUND in codes

    health = server.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert wait_for(lambda: cache_is_empty(server), timeout=20)
    after = server.stub.Generate(good, timeout=60)
    assert_completed(after, good.prompt, 16)
    assert after.text == before.text  # nothing left behind changes what a request gets


def test_message_over_the_grpc_limit_is_resource_exhausted(server: ServerProcess) -> None:
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="z" * (5 << 20)), timeout=30)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    response = server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="ok", max_new_tokens=2), timeout=10)
    assert_completed(response, "ok", 2)


def test_cancellation_storm_leaks_nothing_and_spares_the_others(server: ServerProcess) -> None:
    seed = 5  # every task draws from its own generator: draws do not depend on thread scheduling
    keep = [pb.GenerateRequest(model="alibi", prompt=f"def keep_{i}(x):\n", max_new_tokens=24) for i in range(8)]
    alone = [server.stub.Generate(r, timeout=60).text for r in keep]

    def storm(index: int) -> None:
        rng = random.Random(f"{seed}/storm/{index}")
        prompt = "import os\n" * rng.choice([1, 50, 200])  # short, or a long prefill
        stream = server.stub.GenerateStream(
            pb.GenerateRequest(model=rng.choice(MODELS[:1]), prompt=prompt, max_new_tokens=32), timeout=60
        )
        point = index % 3
        try:
            if point == 0:
                stream.cancel()  # before admission
            elif point == 1:
                time.sleep(rng.uniform(0, 0.02))  # during prefill
                stream.cancel()
            else:
                for _ in range(rng.randint(1, 5)):  # mid-decode
                    next(stream)
                stream.cancel()
        except (grpc.RpcError, StopIteration):
            pass

    def deadline(index: int) -> None:
        rng = random.Random(f"{seed}/deadline/{index}")
        request = pb.GenerateRequest(model="alibi", prompt="class T:\n", max_new_tokens=32)
        try:
            server.stub.Generate(request, timeout=rng.uniform(0.001, 0.2))
        except grpc.RpcError as error:
            assert error.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK)

    with ThreadPoolExecutor(max_workers=48) as pool:
        kept = [pool.submit(server.stub.Generate, r, timeout=120) for r in keep]
        jobs = [pool.submit(storm, i) for i in range(240)] + [pool.submit(deadline, i) for i in range(60)]
        for job in jobs:
            job.result()
        together = [future.result().text for future in kept]
    assert together == alone
    assert wait_for(lambda: cache_is_empty(server), timeout=20)
    # p95 of cancel -> freed, from the server's own histogram.
    buckets = []
    for line in server.metrics().splitlines():
        if line.startswith("posenc_cancellation_latency_seconds_bucket{") and 'model="alibi"' in line:
            bound = line.split('le="')[1].split('"')[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1]
    assert total >= 100
    p95_bound = next(bound for bound, count in buckets if count >= 0.95 * total)
    assert p95_bound <= 0.5, buckets


def test_overload_gets_fast_resource_exhausted_and_accepted_work_completes(repository: Path) -> None:
    server = ServerProcess(repository, "--models", "alibi", "--max-batch-size", "4", "--max-queue", "4").wait_serving()
    try:
        request = pb.GenerateRequest(model="alibi", prompt="def run():\n", max_new_tokens=24)
        expected = server.stub.Generate(request, timeout=60).text
        results: list[tuple[grpc.StatusCode, float, str]] = []
        lock = threading.Lock()

        def call(_: int) -> None:
            started = time.perf_counter()
            try:
                text, code = server.stub.Generate(request, timeout=120).text, grpc.StatusCode.OK
            except grpc.RpcError as error:
                text, code = "", error.code()
            with lock:
                results.append((code, time.perf_counter() - started, text))

        with ThreadPoolExecutor(max_workers=64) as pool:
            list(pool.map(call, range(64)))
        rejected = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
        accepted = [r for r in results if r[0] == grpc.StatusCode.OK]
        assert len(rejected) + len(accepted) == 64
        assert len(rejected) >= 32 and len(accepted) >= 8
        assert max(r[1] for r in rejected) < 2.0  # at once, not after waiting
        assert all(r[2] == expected for r in accepted)
    finally:
        server.stop()


def test_restart_after_sigkill_comes_back_healthy(repository: Path) -> None:
    port, metrics_port = free_port(), free_port()
    first = ServerProcess(repository, "--models", "none", port=port, metrics_port=metrics_port).wait_serving()
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=10)
    first.stop()
    second = ServerProcess(repository, "--models", "none", port=port, metrics_port=metrics_port).wait_serving()
    try:
        response = second.stub.Generate(pb.GenerateRequest(model="none", prompt="a", max_new_tokens=3), timeout=10)
        assert_completed(response, "a", 3)
    finally:
        second.stop()


def test_inference_failure_fails_only_the_affected_requests(repository: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSENC_FAULT_INJECTION_MARKER", "<<boom>>")
    server = ServerProcess(repository, "--models", "alibi", "none").wait_serving()
    try:
        good = pb.GenerateRequest(model="alibi", prompt="def ok():\n", max_new_tokens=16)
        expected = server.stub.Generate(good, timeout=30).text
        bad = pb.GenerateRequest(model="alibi", prompt="x = '<<boom>>'\n", max_new_tokens=16)
        with ThreadPoolExecutor(max_workers=16) as pool:  # good and bad prompts share prefill batches
            goods = [pool.submit(server.stub.Generate, good, timeout=60) for _ in range(8)]
            bads = [pool.submit(server.stub.Generate, bad, timeout=60) for _ in range(4)]
            assert all(future.result().text == expected for future in goods)
            for future in bads:
                with pytest.raises(grpc.RpcError) as error:
                    future.result()
        assert error.value.code() == grpc.StatusCode.INTERNAL
        assert "injected fault" in error.value.details()
        assert "injected fault" in server.output()  # the cause is logged
        assert server.stub.Generate(good, timeout=30).text == expected
        assert wait_for(lambda: server.metric("posenc_kv_cache_used_bytes", model="alibi") == 0)
    finally:
        server.stop()


def test_a_port_taken_before_the_server_binds_it_is_replaced(repository: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Free-port probing races with other sockets; the launcher starts again on new ports."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], free_port()])
    real_free_port = service.process.free_port
    monkeypatch.setattr(service.process, "free_port", lambda: next(ports, None) or real_free_port())
    server = ServerProcess(repository, "--models", "none")
    try:
        assert server.port == taken.getsockname()[1]
        server.wait_serving()
        assert server.port != taken.getsockname()[1]
        assert server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models[0].name == "none"
    finally:
        server.stop()
        taken.close()
