"""Operability through the real server: every RPC counted once with the code its client saw,
undecodable bytes answered INVALID_ARGUMENT, visible draining, health List, load shedding on a
time-to-first-token target, and metrics a scrape can afford."""

from __future__ import annotations

import collections
import json
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from service.api import generation_pb2 as pb
from service.process import ServerProcess, wait_for

REPEATS = 10
GENERATE = "/posenc.v1.Generation/Generate"
LONG_PROMPT = "def long_function(argument):\n    return argument * 2\n" * 60  # ~3000 bytes


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(repository, "--models", "alibi", "--max-queue", "512").wait_serving()
    yield process
    process.stop()


def request_counts(server: ServerProcess, text: str | None = None) -> collections.Counter[tuple[str, str]]:
    """posenc_requests_total by (method, code), from one scrape (or the exposition `text`)."""
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in (server.metrics() if text is None else text).splitlines():
        if line.startswith("posenc_requests_total{"):
            head, _, value = line.rpartition(" ")
            labels = dict(part.split("=", 1) for part in head[head.index("{") + 1 : -1].split(","))
            counts[(labels["method"].strip('"'), labels["code"].strip('"'))] += int(float(value))
    return counts


def raw_generate_request(model: bytes, prompt: bytes) -> bytes:
    """GenerateRequest wire bytes built by hand: field 1 (model) and 2 (prompt), length-delimited."""
    return b"\x0a" + bytes([len(model)]) + model + b"\x12" + bytes([len(prompt)]) + prompt


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def cancel_after(server: ServerProcess, chunks: int) -> grpc.StatusCode:
    request = pb.GenerateRequest(model="alibi", prompt="def f(x):\n", max_new_tokens=200)
    call = server.stub.GenerateStream(request, timeout=60)
    for _ in range(chunks):
        next(call)
    call.cancel()
    return code_of(lambda: list(call))


def test_each_rpc_is_counted_once_with_the_code_its_client_saw(server: ServerProcess) -> None:
    # The deadline cases last over a second (a ~3000-byte prompt, then 1000 tokens) against a
    # 300 ms deadline: long enough that the handler has started when the deadline passes, even on
    # a loaded machine (a call whose deadline passes before its handler starts is dropped by gRPC
    # itself and never reaches the service).
    raw = server.channel.unary_unary(GENERATE)  # bytes in, bytes out: nothing validates on our side
    cases: dict[str, tuple[str, Callable[[], grpc.StatusCode]]] = {
        "stream cancelled after 1 chunk": ("GenerateStream", lambda: cancel_after(server, 1)),
        "stream cancelled after 3 chunks": ("GenerateStream", lambda: cancel_after(server, 3)),
        "unary past a 300 ms deadline": (
            "Generate",
            lambda: code_of(
                lambda: server.stub.Generate(
                    pb.GenerateRequest(model="alibi", prompt=LONG_PROMPT, max_new_tokens=1000), timeout=0.3
                )
            ),
        ),
        "stream past a 300 ms deadline": (
            "GenerateStream",
            lambda: code_of(
                lambda: list(
                    server.stub.GenerateStream(
                        pb.GenerateRequest(model="alibi", prompt=LONG_PROMPT, max_new_tokens=1000), timeout=0.3
                    )
                )
            ),
        ),
        "undecodable bytes": (
            "Generate",
            lambda: code_of(lambda: raw(raw_generate_request(b"alibi", b"\xff\xfe"), timeout=10)),
        ),
        "unknown model": (
            "Generate",
            lambda: code_of(lambda: server.stub.Generate(pb.GenerateRequest(model="nope", prompt="x"), timeout=10)),
        ),
        "finished": (
            "Generate",
            lambda: code_of(
                lambda: server.stub.Generate(
                    pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=2), timeout=30
                )
            ),
        ),
    }
    for name, (method, case) in cases.items():
        before = request_counts(server)
        seen = collections.Counter((method, case().name) for _ in range(REPEATS))
        # A cancelled call is counted when its handler notices (at its next step); wait for it.
        wait_for(lambda before=before: sum((request_counts(server) - before).values()) >= REPEATS, timeout=10)
        counted = request_counts(server) - before
        assert counted == seen, (name, dict(counted), dict(seen))


def test_a_prompt_that_is_not_utf8_is_invalid_argument_naming_the_field(server: ServerProcess) -> None:
    raw = server.channel.unary_unary(GENERATE)
    with pytest.raises(grpc.RpcError) as caught:
        raw(raw_generate_request(b"alibi", b"ok \xc3\x28 bad"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in caught.value.details() and "UTF-8" in caught.value.details(), caught.value.details()
    with pytest.raises(grpc.RpcError) as garbage:
        raw(b"\xff\xff\xff\xff", timeout=10)
    assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid posenc.v1.GenerateRequest" in garbage.value.details()
    output = server.output()
    assert "Traceback" not in output and "Exception deserializing" not in output


def test_health_list_answers_every_service(server: ServerProcess) -> None:
    statuses = server.health.List(health_pb2.HealthListRequest(), timeout=5).statuses
    assert {name: s.status for name, s in statuses.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING,
        "posenc.v1.Generation": health_pb2.HealthCheckResponse.SERVING,
    }


def test_every_method_that_reflection_advertises_answers(server: ServerProcess) -> None:
    """As a client that knows the API only through reflection: no advertised method is UNIMPLEMENTED."""
    database = ProtoReflectionDescriptorDatabase(server.channel)
    pool = DescriptorPool(database)
    called = []
    for name in database.get_services():
        if name.startswith("grpc.reflection."):
            continue  # bidirectional: this very conversation
        for method in pool.FindServiceByName(name).methods:
            path = f"/{name}/{method.full_name.rpartition('.')[2]}"
            if method.server_streaming:
                stream = server.channel.unary_stream(path)
                code = code_of(lambda stream=stream: next(iter(stream(b"", timeout=5))))
            else:
                unary = server.channel.unary_unary(path)
                code = code_of(lambda unary=unary: unary(b"", timeout=5))
            assert code != grpc.StatusCode.UNIMPLEMENTED, path
            called.append(path)
    assert "/grpc.health.v1.Health/List" in called and "/posenc.v1.Generation/Score" in called


def test_metrics_resolve_sub_millisecond_inter_token_latency_without_created_series(server: ServerProcess) -> None:
    server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=4), timeout=30)
    text = server.metrics()
    assert "_created" not in text
    buckets = [
        float(line.split('le="')[1].split('"')[0])
        for line in text.splitlines()
        if line.startswith("posenc_inter_token_latency_seconds_bucket{") and 'model="alibi"' in line
    ]
    assert 0.0001 in buckets and 0.1 in buckets
    assert len([b for b in buckets if 0.0001 <= b <= 0.1]) >= 15


DRAINED_TOKENS = 8000
DRAIN_DELAY_SECONDS = 3


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def watch_port_close(port: int) -> tuple[threading.Thread, list[float]]:
    """A thread that notes (monotonic time) when the port first refuses connections."""
    closed: list[float] = []

    def watch() -> None:
        while port_open(port):
            time.sleep(0.02)
        closed.append(time.monotonic())

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, closed


def final_counts(server: ServerProcess) -> collections.Counter[tuple[str, str]] | None:
    """posenc_requests_total by (method, code) from a scrape that says the server has drained, else None."""
    try:
        text = server.metrics()
    except OSError:
        return None
    if "posenc_drained 1.0" not in text.splitlines():
        return None
    return request_counts(server, text)


def test_draining_is_visible_and_running_streams_finish(repository: Path) -> None:
    """SIGTERM: health NOT_SERVING at once while new calls are still served (--drain-delay-seconds),
    then the port accepts no new call while the running stream finishes; once drained, /metrics
    stays up, posenc_drained 1, until a scrape has read the final counts (--final-scrape-seconds),
    and they count every call. Each step waits on what a client sees (health, the port, the
    stream, /metrics), not on the clock: a busy machine makes it slower, not wrong."""
    server = ServerProcess(
        repository, "--models", "alibi", "--grace-seconds", "300", "--max-new-tokens-limit", str(DRAINED_TOKENS),
        "--max-sequence-tokens", str(DRAINED_TOKENS + 64), "--drain-delay-seconds", str(DRAIN_DELAY_SECONDS),
        "--final-scrape-seconds", "60",
    ).wait_serving()  # fmt: skip
    try:
        # Long enough (several seconds: steps slow as the context grows) that the server is still
        # draining it while we look.
        stream = server.stub.GenerateStream(
            pb.GenerateRequest(model="alibi", prompt="def f(x):\n", max_new_tokens=DRAINED_TOKENS), timeout=600
        )
        first = next(stream)
        server.process.send_signal(signal.SIGTERM)

        def not_serving() -> bool:
            try:
                response = server.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            except grpc.RpcError:
                return False
            return response.status == health_pb2.HealthCheckResponse.NOT_SERVING

        watcher, closed = watch_port_close(server.port)
        assert wait_for(not_serving, timeout=10), server.output()[-3000:]
        served = server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=2), timeout=10)
        answered = time.monotonic()
        assert served.usage.completion_tokens == 2
        watcher.join(timeout=60)
        assert closed and answered < closed[0]  # served within the delay: before the port closed
        with pytest.raises(grpc.RpcError) as refused:  # the port is closed: a proxy or a retry goes elsewhere
            server.stub.Generate(pb.GenerateRequest(model="alibi", prompt="x", max_new_tokens=2), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)
        assert rest[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert rest[-1].usage.completion_tokens == DRAINED_TOKENS
        assert len(first.text + "".join(c.text for c in rest)) > 0
        # Drained: the final counts, the stream that finished during the drain included, until read once.
        final: list[collections.Counter[tuple[str, str]]] = []

        def drained() -> bool:
            counts = final_counts(server)
            final.extend([counts] if counts is not None else [])
            return bool(final)

        assert wait_for(drained, timeout=60)
        assert final[0] == {("GenerateStream", "OK"): 1, ("Generate", "OK"): 1}, final[0]
        assert server.process.wait(timeout=30) == 0  # that scrape was the last it waited for
        output = server.output()
        assert "1 in-flight request(s) finished, 0 cut" in output, output[-2000:]
        assert "drained: a scrape read the final counters" in output, output[-2000:]
    finally:
        server.stop()


def test_ttft_target_sheds_load_with_a_retry_hint_and_counts_it(repository: Path) -> None:
    # Every prompt alike: with the prefix cache nearly nothing would be computed, nor shed.
    server = ServerProcess(
        repository, "--models", "alibi", "--ttft-slo-seconds", "0.2", "--max-queue", "512", "--no-prefix-cache",
        threads=1,
    ).wait_serving()  # fmt: skip
    try:
        prompt = "def handler(request, context):\n    return request.value + 1\n" * 12  # ~700 bytes
        # Measured prefill throughput first: the estimate admits everything until it has one.
        server.stub.Generate(pb.GenerateRequest(model="alibi", prompt=prompt, max_new_tokens=2), timeout=60)
        outcomes: list[tuple[grpc.StatusCode, dict[str, str]]] = []
        lock = threading.Lock()

        def call(index: int) -> None:
            request = pb.GenerateRequest(model="alibi", prompt=prompt, max_new_tokens=8, seed=index)
            try:
                list(server.stub.GenerateStream(request, timeout=120))
                result = (grpc.StatusCode.OK, {})
            except grpc.RpcError as error:
                result = (error.code(), dict(error.trailing_metadata() or ()))
            with lock:
                outcomes.append(result)

        with ThreadPoolExecutor(max_workers=48) as pool:
            list(pool.map(call, range(96)))
        refused = [meta for code, meta in outcomes if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        served = [code for code, _ in outcomes if code == grpc.StatusCode.OK]
        assert refused and served, collections.Counter(code.name for code, _ in outcomes)
        assert len(refused) + len(served) == len(outcomes)
        assert all(int(meta["retry-after-ms"]) > 0 for meta in refused)
        shed = server.metric("posenc_requests_shed_total", model="alibi", reason="ttft_slo")
        assert shed == len(refused)
        assert request_counts(server)[("GenerateStream", "RESOURCE_EXHAUSTED")] == len(refused)
        assert wait_for(lambda: server.metric("posenc_kv_cache_used_bytes", model="alibi") == 0, timeout=10)
    finally:
        server.stop()


def test_rope_scaling_variants_are_served_only_when_named(repository: Path, tmp_path: Path) -> None:
    folder = tmp_path / "repository"
    folder.mkdir()
    for name in ("alibi", "rope"):
        (folder / name).symlink_to(repository / name)
    variant = folder / "rope-linear-x2"
    shutil.copytree(repository / "rope", variant)
    manifest = json.loads((variant / "manifest.json").read_text())
    manifest.update(name="rope-linear-x2", rope_scaling={"kind": "linear", "factor": 2.0})
    (variant / "manifest.json").write_text(json.dumps(manifest))
    default = ServerProcess(folder).wait_serving()
    try:
        names = [m.name for m in default.stub.ListModels(pb.ListModelsRequest(), timeout=10).models]
        assert names == ["alibi", "rope"]
        assert "not serving rope scaling variants rope-linear-x2" in default.output()
    finally:
        default.stop()
    named = ServerProcess(folder, "--models", "rope", "rope-linear-x2").wait_serving()
    try:
        names = [m.name for m in named.stub.ListModels(pb.ListModelsRequest(), timeout=10).models]
        assert names == ["rope", "rope-linear-x2"]
    finally:
        named.stop()
